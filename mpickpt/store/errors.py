"""Errors raised while reading checkpoints."""


class CheckpointError(Exception):
    """A checkpoint cannot be used: missing, torn, corrupted or inconsistent. The message names the
    file (and dataset) and what was wrong."""


class CheckpointCorruptError(CheckpointError):
    """A file's bytes do not match what was written (checksum, truncation, unreadable HDF5)."""

"""Exact reader positions: small, serializable states saying where the next global batch starts.

A position is what a checkpoint stores for the input pipeline. It is identical on every rank (all
ranks walk the same global stream and keep only their slice), so restoring it on any world size
continues the global stream with no sample skipped or repeated.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Union


def _check_counts(position, minimum: dict[str, int]) -> None:
    """Raise ValueError unless every field of ``position`` is an int >= its minimum. Local."""
    for f in fields(position):
        value = getattr(position, f.name)
        low = minimum.get(f.name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{type(position).__name__}.{f.name} must be an integer >= {low}, "
                             f"got {value!r}")


def _fields_from_dict(cls, kind: str, data: dict, optional: tuple[str, ...] = ()) -> dict:
    """Pick ``cls``'s fields from ``data`` after checking its 'kind' tag; the fields named in
    `optional` (added after checkpoints were written without them) take their defaults. Local."""
    if data.get("kind") != kind:
        raise ValueError(f"expected a reader position of kind {kind!r}, got kind {data.get('kind')!r}")
    missing = [f.name for f in fields(cls) if f.name not in data and f.name not in optional]
    if missing:
        raise ValueError(f"{kind} reader position is missing {', '.join(missing)}: {data!r}")
    return {f.name: int(data[f.name]) for f in fields(cls) if f.name in data}


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticPosition:
    """Position in the synthetic stream: the global index of the next sample."""

    sample_index: int = 0
    """Global index of the first sample of the next global batch, >= 0."""

    def __post_init__(self):
        _check_counts(self, {})

    def to_dict(self) -> dict:
        """JSON-ready dict with a 'kind' tag. Local."""
        return {"kind": "synthetic", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> SyntheticPosition:
        """Inverse of ``to_dict``. Local."""
        return cls(**_fields_from_dict(cls, "synthetic", data))


@dataclass(frozen=True, kw_only=True, slots=True)
class TSVPosition:
    """Position in a sequence of Criteo TSV files: where the next line is, and counts so far."""

    file_index: int = 0
    """Index into the configured paths of the file holding the next line."""
    byte_offset: int = 0
    """Byte offset of the next line in that file."""
    line_number: int = 1
    """1-based line number of the next line in that file (for error messages)."""
    sample_index: int = 0
    """Valid lines (samples) consumed so far over all files."""
    bad_lines: int = 0
    """Malformed lines skipped so far (skip mode only)."""
    tail_length: int = 0
    """Bytes of the last line consumed, which ends at `byte_offset` in the same file (0: none
    consumed, or a checkpoint written before this field)."""
    tail_crc: int = 0
    """CRC-32 of that line: a resume checks it, so that a file changed since the checkpoint
    is named instead of read from a position that means nothing in it."""

    def __post_init__(self):
        _check_counts(self, {"line_number": 1})

    def to_dict(self) -> dict:
        """JSON-ready dict with a 'kind' tag. Local."""
        return {"kind": "tsv", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> TSVPosition:
        """Inverse of ``to_dict``. Local."""
        return cls(**_fields_from_dict(cls, "tsv", data, ("tail_length", "tail_crc")))


ReaderState = Union[SyntheticPosition, TSVPosition]


def position_from_dict(data: dict) -> ReaderState:
    """Rebuild whichever position ``data`` (from ``to_dict``) describes, by its 'kind'. Local."""
    kinds = {"synthetic": SyntheticPosition, "tsv": TSVPosition}
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in kinds:
        raise ValueError(f"reader position kind must be one of {sorted(kinds)}, got {kind!r}")
    return kinds[kind].from_dict(data)

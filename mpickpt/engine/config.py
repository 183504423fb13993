"""Configuration of the checkpoint engine (the `--ckpt-*` flags are declared here)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from mpickpt.engine.core_split import MODES as CORE_MODES
from mpickpt.incrcp.held_bundle import HOLD_BYTES, check_hold
from mpickpt.kinds.incrcp import RESETS as INCRCP_RESETS
from mpickpt.kinds.priority import DEFAULT_FRACTION
from mpickpt.kinds.priority import RULES as PRIORITY_RULES
from mpickpt.kinds.registry import KINDS
from mpickpt.options import (OutputError, changed_flags, check_output, int_at_least, only_applies,
                             option, positive_float, ratio)
from mpickpt.quant.config import QuantConfig
from mpickpt.store import replacing
from mpickpt.store.sealed_json import DamagedRecord

OVERLAP_POLICIES = ("wait", "skip")
IO_MODES = ("direct", "buffered")
DEFAULT_INTERVAL = 100
AUTO = "auto"


def _interval(text: str) -> int | str:
    if text == AUTO:
        return AUTO
    return int_at_least(1)(text)


_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30}


def _size(flag: str):
    """A parser of `flag`'s value: '0', '65536', '64K', '1M', '4MiB' -> bytes (binary units)."""
    def parse(text: str) -> int:
        raw = str(text).strip().lower()
        number = raw.rstrip("kmgib")
        unit = raw[len(number):]
        if not number.isdigit() or unit not in _UNITS:
            raise ValueError(f"{flag} must be a size in bytes such as 0, 65536, 64K or 1M, got "
                             f"{text!r}")
        return int(number) * _UNITS[unit]
    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"--ckpt-save-fraction must lie in (0, 1], got {text!r}")
    return value


KIND_OPTIONS = {"priority": ("save_fraction", "priority_baseline_every"),
                "incrcp": ("incrcp_ratio", "incrcp_reset", "incrcp_hold", "inject_extract_crash")}
"""The options only one kind reads (`CheckpointConfig` refuses them with another)."""
KIND_HOW = {"priority": " (set by --ckpt-priority RULE)"}


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Where, how often and how checkpoints are written and restored."""

    OPTION_GROUP: ClassVar[str] = "checkpoint"

    directory: str | None = option(None, flag="--ckpt-dir")
    """checkpoint root directory, one per job (a parallel filesystem on clusters); checkpointing
    is on when it is given"""
    interval: int | str | None = option(None, flag="--ckpt-interval", parse=_interval)
    """batches between checkpoints, or 'auto': Young's interval sqrt(2 O_save T_fail) from the
    measured save cost and --mtbf, re-planned after every checkpoint (default: 100, or from
    --target-pls / --recovery auto)"""
    keep: int = option(2, flag="--ckpt-keep", parse=int_at_least(1))
    """committed checkpoints to retain; older ones are deleted after a newer commit"""
    final: bool = option(False, flag="--ckpt-final", switch=True)
    """also checkpoint the run's last step (the trained model) unless the interval just did"""
    resume: str = option("latest", flag="--resume")
    """'latest' (newest valid, falling back past corrupted ones), 'none', or a step"""
    writers: int = option(1, flag="--ckpt-writers", parse=int_at_least(1))
    """background writer processes per rank (one part file each)"""
    align: int = option(1 << 20, flag="--ckpt-align", parse=_size("--ckpt-align"),
                        metavar="BYTES")
    """datasets of at least this size start at a multiple of it in the files, so that no two
    share a parallel filesystem stripe: the stripe size (0: packed)"""
    io: str = option("direct", flag="--ckpt-io", choices=IO_MODES)
    """how the writers write shard and dense files' large datasets, and the IncrCP extractor its
    bundles': direct (O_DIRECT, past the page cache: no copy of the bytes and no writeback work,
    the least CPU per byte; buffered where the filesystem refuses it) or buffered (through the
    page cache, which then holds the checkpoint for a restore soon after); see
    mpickpt/store/direct_io.py"""
    snapshot: str = option("stop-the-world", flag="--ckpt-snapshot",
                           choices=("stop-the-world", "copy-on-update"))
    """how a checkpoint copies the rows: all at once in the stall, or copy-on-update (only the
    dense part in the stall; each row copied in the background or before its first update,
    byte-identical; CPU models, and CUDA models with CuPy: kernels/pending_rows.cu; see
    mpickpt/engine/copy_on_update.py)"""
    background: str = option("idle", flag="--ckpt-background", choices=("idle", "low", "normal"))
    """CPU and I/O priority of the writers (CRC, quantizer) and the IncrCP extractor: idle
    (SCHED_IDLE, idle I/O: only what training leaves), low (SCHED_BATCH, best-effort 7), normal
    (see mpickpt.background_priority); a checkpoint before a stop runs at normal"""
    cores: str = option("shared", flag="--ckpt-cores", choices=CORE_MODES)
    """where the background runs: shared (anywhere in the rank's cores, as training), split
    (training's thread on the cores it needs, the writers, extractor, copier and commit thread
    on the rest of the rank's share; no split where training needs them all), auto (split
    where a core is free); see mpickpt/engine/core_split.py"""
    overlap: str = option("wait", flag="--ckpt-overlap", choices=OVERLAP_POLICIES)
    """when the previous checkpoint is still being written: wait for it, or skip this one"""
    kind: str = option("full", flag="--ckpt-kind", choices=KINDS)
    """full; differential (one-shot baseline); consecutive; intermittent (differential with
    Check-N-Run's baseline predictor); incrcp (consecutive increments in IncrCP's 2-D chunk
    store); priority (prioritized partial saves, set by --ckpt-priority)"""
    priority: str | None = option(None, flag="--ckpt-priority", choices=PRIORITY_RULES)
    """prioritized partial saves (CPR, SCAR; implies --ckpt-kind priority): each save writes the
    r N rows of each table most used since their last save (mfu), a subsampled list of used rows
    (ssu), or the most changed since their last save (scar)"""
    save_fraction: float = option(DEFAULT_FRACTION, flag="--ckpt-save-fraction", parse=_fraction,
                                  metavar="R")
    """prioritized saves: the fraction r of each table's rows one save may write"""
    priority_baseline_every: int | None = option(None, parse=int_at_least(0), metavar="K")
    """prioritized saves: a full baseline every K saves (0: only the first; default 4·ceil(1/r))"""
    incrcp_ratio: float = option(0.02, parse=ratio)
    """IncrCP's selective-extraction threshold R (0..1)"""
    incrcp_reset: str = option("cost", choices=INCRCP_RESETS)
    """incrcp baselines: IncrCP's cost model (construction + extrapolated recovery time), or
    never (one chain per run)"""
    incrcp_hold: int = option(HOLD_BYTES, parse=_size("--incrcp-hold"), metavar="BYTES")
    """memory the extractor may keep its last row-0 bundle in, for the next ingestion to read
    instead of the file (0: read every bundle from its file); see mpickpt/incrcp/held_bundle.py"""
    inject_extract_crash: int | None = option(None, parse=int_at_least(1), metavar="N",
                                              group="faults")
    """rank 0's extractor SIGKILLs itself in its N-th ingestion, after writing the bundles and
    before committing the chunk index"""
    inject_slow_copy: float | None = option(None, parse=positive_float, metavar="SECONDS",
                                            group="faults")
    """--ckpt-snapshot copy-on-update: the background copier copies 16 rows at a time and sleeps
    SECONDS after each chunk, so that a checkpoint's rows stay pending across later steps (tests
    of a kill, a survivor dump or a stop signal during the copy)"""
    quant: QuantConfig = field(default_factory=QuantConfig)
    """How checkpoints are quantized."""

    def __post_init__(self):
        if not self.directory:
            raise ValueError(f"--ckpt-dir must name a directory, got {self.directory!r}")
        if self.priority is not None and self.kind == "full":
            object.__setattr__(self, "kind", "priority")
        if self.priority is not None and self.kind != "priority":
            raise ValueError(f"--ckpt-priority {self.priority} makes prioritized partial saves, "
                             f"a kind of its own; it cannot go with --ckpt-kind {self.kind}")
        if self.interval is not None and self.interval != AUTO and (
                not isinstance(self.interval, int) or self.interval < 1):
            raise ValueError(f"--ckpt-interval must be an integer >= 1 or 'auto', got "
                             f"{self.interval!r}")
        for name in ("keep", "writers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--ckpt-{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.align, int) or self.align < 0:
            raise ValueError(f"--ckpt-align must be a size in bytes >= 0, got {self.align!r}")
        if not 0.0 < self.save_fraction <= 1.0:
            raise ValueError(f"--ckpt-save-fraction must lie in (0, 1], got "
                             f"{self.save_fraction!r}")
        if self.overlap not in OVERLAP_POLICIES:
            raise ValueError(f"--ckpt-overlap must be 'wait' or 'skip', got {self.overlap!r}")
        if self.io not in IO_MODES:
            raise ValueError(f"--ckpt-io must be one of {', '.join(IO_MODES)}, got {self.io!r}")
        if self.kind not in KINDS:
            raise ValueError(f"--ckpt-kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.incrcp_reset not in INCRCP_RESETS:
            raise ValueError(f"--incrcp-reset must be 'cost' or 'never', got {self.incrcp_reset!r}")
        check_hold(self.incrcp_hold)
        if not 0.0 <= self.incrcp_ratio <= 1.0:
            raise ValueError(f"--incrcp-ratio must lie in [0, 1], got {self.incrcp_ratio!r}")
        if self.inject_slow_copy is not None and self.snapshot != "copy-on-update":
            raise ValueError("--inject-slow-copy slows the copy-on-update copier; it needs "
                             "--ckpt-snapshot copy-on-update")
        if self.resume not in ("latest", "none") and not str(self.resume).isdigit():
            raise ValueError(f"--resume must be 'latest', 'none' or a step number, got {self.resume!r}")

    def check_kind_options(self) -> None:
        """Another kind's options given with this kind (which would ignore them): ValueError
        naming them. The trainer's flags only: a library caller may set them all. Local."""
        for kind, names in KIND_OPTIONS.items():
            stray = changed_flags(CheckpointConfig, self, names)
            if stray and self.kind != kind:
                raise ValueError(only_applies(stray, f"--ckpt-kind {kind}{KIND_HOW.get(kind, '')}",
                                              f"--ckpt-kind {self.kind}"))

    @property
    def auto_interval(self) -> bool:
        return self.interval == AUTO

    @property
    def fixed_interval(self) -> int | None:
        """The interval given as a number, or None (default or planned). Local."""
        return self.interval if isinstance(self.interval, int) else None

    def resume_in_force(self, environ, train_until: int | None = None
                        ) -> tuple[str, str | None]:
        """`--resume` as this launch applies it, and what to say about it. A chosen step or
        `none` is where the job starts: a relaunch of the same command (`mpickpt-run`'s restarts,
        a requeued Slurm job) continues from the newest checkpoint instead, since going back
        again would throw away what the failed launch trained; unless the failed launch ended
        before it had retired the newer checkpoints it replaces (`store.replacing`), or the run
        trains nothing past its chosen step (`train_until`, the run's last step: a digest or an
        evaluation of that step): the relaunch starts there again then. Local (reads the
        directory's record)."""
        from mpickpt.job_variables import relaunches

        if self.resume == "latest":
            return "latest", None
        again = relaunches(environ)
        if not again:
            return self.resume, None
        relaunch = f"this is a relaunch ({', '.join(again)})"
        step = self.resume_step
        if step is not None and train_until is not None and step >= train_until:
            return self.resume, (f"--resume {self.resume}: {relaunch} of a run that trains "
                                 f"nothing past step {step} (its last step is {train_until}): "
                                 f"it starts there again")
        try:
            under_way = replacing.pending(self.directory)
        except (OSError, DamagedRecord) as e:
            return "latest", (f"--resume {self.resume} applies to the job's first launch; "
                              f"{relaunch}, and the record of whether the first launch carried "
                              f"it out is unreadable ({e}): it resumes as relaunches do")
        if under_way == str(self.resume):
            return self.resume, (f"--resume {self.resume}: {relaunch} of a launch that ended "
                                 f"before it had retired the newer checkpoints it replaces "
                                 f"({replacing.path_of(self.directory)}): it starts there again")
        return "latest", (f"--resume {self.resume} applies to the job's first launch; "
                          f"{relaunch}: it resumes as relaunches do")

    @property
    def resume_step(self) -> int | None:
        """The chosen step, or None for 'latest'/'none'. Local."""
        return int(self.resume) if str(self.resume).isdigit() else None

    def check_directory(self) -> None:
        """Create the directory if needed; OutputError naming it when it cannot be used, or
        when something other than a file holds the name of mpickpt's record of a chosen start
        (`store.replacing`). Local."""
        check_output("--ckpt-dir", self.directory, folder=True)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise OutputError(f"--ckpt-dir {self.directory}: cannot be created: "
                              f"{e.strerror}") from None
        record = replacing.path_of(self.directory)
        if os.path.lexists(record) and not os.path.isfile(record):
            raise OutputError(f"--ckpt-dir {self.directory}: {record} is not a file; mpickpt "
                              f"keeps its record of a chosen start (--resume) under that name: "
                              f"move it away")

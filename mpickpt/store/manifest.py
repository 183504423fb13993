"""Manifests: the commit record of a checkpoint. A checkpoint exists only once its manifest does.

``<dir>/manifest-<step>.json`` is written by rank 0 after every rank reported its files durable:
temp file, fsync, rename, fsync of the directory. It lists every file of the checkpoint with its
size and the CRC32 of its bytes, so a truncated or deleted file is noticed before any HDF5 is
opened and `mpickpt verify` can check a file at the speed of a sequential read, and carries a
checksum of its own content (`store.sealed_json`): a damaged or edited manifest is refused like a
damaged shard. The HDF5 attributes restore trusts are covered in each file, by the digest in its
``/_attrs`` dataset (`store.attr_digest`), not by the manifest.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import MISSING, asdict, dataclass, field, fields

from mpickpt.store.errors import CheckpointError
from mpickpt.store.sealed_json import DamagedRecord, dumps_sealed, read_sealed
from mpickpt.store.durable import fsync_path

MANIFEST_RE = re.compile(r"^manifest-(\d{12})\.json$")
MANIFEST_VERSION = 2
FIRST_SEALED_VERSION = 2
"""Manifests from version 2 on carry a checksum of their content (version 1 ones are read
without, as written before checksums existed)."""


@dataclass
class Manifest:
    """What rank 0 commits for one checkpoint (JSON)."""

    step: int
    kind: str
    ckpt_id: str
    """Directory (relative to the checkpoint root) holding this checkpoint's own files."""
    world_size: int
    dim: int
    plan: dict
    optimizer: str
    files: dict[str, dict]
    """Relative path -> {"size": bytes, "crc32": CRC32 of the whole file, "role":
    "shard"|"dense"|"extra", "rank": r, "part": j}. (The digest of a file's HDF5 attributes is
    kept in the file itself, `store.attr_digest`.)"""
    reader_state: dict
    codec: str = "fp32"
    parents: list[int] = field(default_factory=list)
    """Steps this checkpoint builds on, oldest first: [] for full; [baseline] for differential;
    [baseline, every earlier increment of the chain] for consecutive; [baseline] for incrcp (its
    chunk index locates the increments; ``stats["columns"]`` lists the chain's steps)."""
    chain: str = ""
    """incrcp: the chain (2-D chunk lists under ``chains/<chain>/``) this checkpoint belongs to or,
    for a full baseline, starts."""
    stats: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    version: int = MANIFEST_VERSION
    source = ""
    """The file it was read from (`load_manifest`; not a field, never written): where a missing
    parent's manifest would be, so that a damaged one can be named."""

    def shard_files(self) -> list[str]:
        """Relative paths of the embedding shard files, ordered by (rank, part). Local."""
        shards = [(v["rank"], v["part"], k) for k, v in self.files.items() if v["role"] == "shard"]
        return [k for _, _, k in sorted(shards)]

    def dense_file(self) -> str:
        """Relative path of the replicated dense-state file. Local."""
        return next(k for k, v in self.files.items() if v["role"] == "dense")

    def total_bytes(self) -> int:
        return sum(v["size"] for v in self.files.values())


def parent_manifests(manifest: Manifest, by_step: dict[int, Manifest]) -> list[Manifest]:
    """The committed manifests `manifest` builds on, oldest first; CheckpointError if one is gone.
    Local."""
    out = []
    for step in manifest.parents:
        if step not in by_step:
            raise CheckpointError(f"checkpoint step {manifest.step} ({manifest.kind}) needs step "
                                  f"{step}, {_why_absent(manifest, step)}")
        parent = by_step[step]
        if attempt_of(parent.ckpt_id) != attempt_of(manifest.ckpt_id):  # every run starts a chain
            raise CheckpointError(f"checkpoint step {manifest.step} ({manifest.kind}) needs step "
                                  f"{step} of its own run ({attempt_of(manifest.ckpt_id)}), but "
                                  f"step {step} was rewritten by another run "
                                  f"({attempt_of(parent.ckpt_id)}): its rows would be layered "
                                  f"on another model's")
        out.append(parent)
    return out


def attempt_of(ckpt_id: str) -> str:
    """The run (attempt id) that wrote a checkpoint, from its directory's name
    (`file_spec.checkpoint_id`). Local."""
    return ckpt_id.rsplit("-", 1)[-1]


def _why_absent(manifest: Manifest, step: int) -> str:
    """Why parent `step` of `manifest` is not among the readable manifests: its manifest beside
    `manifest`'s is damaged (named, with the problem), or there is none. Local."""
    path = manifest_path(os.path.dirname(manifest.source), step) if manifest.source else ""
    if path and os.path.exists(path):
        try:
            load_manifest(path)
        except ValueError as e:
            return f"whose manifest cannot be used: {e}"
    return "which is not committed (retired or deleted)"


def manifest_path(root: str, step: int) -> str:
    return os.path.join(root, f"manifest-{step:012d}.json")


def write_manifest(root: str, manifest: Manifest) -> str:
    """Atomically publish `manifest` (temp + fsync + rename + directory fsync). Local (rank 0)."""
    final = manifest_path(root, manifest.step)
    tmp = os.path.join(root, f".{os.path.basename(final)}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(dumps_sealed(asdict(manifest), indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_path(root)
    return final


def load_manifest(path: str) -> Manifest:
    """Read one manifest, checking its checksum; ValueError naming the file when it is damaged or
    not a valid manifest. Local."""
    data = None
    try:
        data = read_sealed(path, "version", FIRST_SEALED_VERSION)
        manifest = Manifest(**data)
        manifest.source = path
        return manifest
    except DamagedRecord as e:
        raise ValueError(f"{path}: not a valid mpickpt manifest: {e.reason}") from None
    except TypeError:  # Manifest(**data): fields missing or unknown
        raise ValueError(f"{path}: not a valid mpickpt manifest: {_fields_problem(data)}") \
            from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a valid mpickpt manifest: {e}") from None


def _fields_problem(data: dict) -> str:
    """What keeps `data` (a JSON object: `read_sealed` refuses other values) from being a
    Manifest's fields. Local."""
    known = {f.name: f for f in fields(Manifest) if f.init}
    missing = [n for n, f in known.items() if n not in data and f.default is MISSING
               and f.default_factory is MISSING]
    unknown = sorted(str(k) for k in data if k not in known)
    return "; ".join(([f"no {', '.join(missing)}"] if missing else []) +
                     ([f"unknown fields {', '.join(unknown)}"] if unknown else []))


def list_manifests(root: str, damaged: list | None = None) -> list[Manifest]:
    """Committed checkpoints under `root`, oldest first. An unreadable or damaged manifest is
    skipped: appended to `damaged` as (step from its name, message naming the file) when a list is
    given (callers that report them: the restorer, `verify`), else in silence (retention, the
    extractor, a commit's message: the restorer names it when a run starts). Local."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        match = MANIFEST_RE.match(name)
        if match:
            try:
                out.append(load_manifest(os.path.join(root, name)))
            except ValueError as e:
                if damaged is not None:
                    damaged.append((int(match.group(1)), str(e)))
    return sorted(out, key=lambda m: m.step)


def manifest_steps(root: str) -> set[int]:
    """Steps that have a manifest file, readable or not. Local."""
    if not os.path.isdir(root):
        return set()
    return {int(m.group(1)) for m in map(MANIFEST_RE.match, os.listdir(root)) if m}


def referenced_dirs(manifests) -> set[str]:
    """Top-level checkpoint directories (and chains/<id>) that some manifest needs. Local."""
    dirs = {path.split("/", 1)[0] for m in manifests for path in m.files}
    return dirs | {f"chains/{m.chain}" for m in manifests if m.chain}


def with_parents(chosen, manifests) -> list:
    """`chosen` plus every manifest they build on (transitively), by step. Local."""
    by_step = {m.step: m for m in manifests}
    out, todo = {}, list(chosen)
    while todo:
        m = todo.pop()
        if m.step not in out:
            out[m.step] = m
            todo += [by_step[p] for p in m.parents if p in by_step]
    return sorted(out.values(), key=lambda m: m.step)


def torn_dirs(root: str, manifests) -> list[str]:
    """Checkpoint directories no manifest refers to (interrupted or abandoned writes). A directory
    whose step has a manifest file that could not be read is not torn: it is kept (and reported
    with its damaged manifest) rather than deleted. Local."""
    if not os.path.isdir(root):
        return []
    needed = referenced_dirs(manifests)
    unread = manifest_steps(root) - {m.step for m in manifests}
    return sorted(d for d in os.listdir(root)
                  if STEP_DIR.match(d) and d not in needed and _dir_step(d) not in unread
                  and os.path.isdir(os.path.join(root, d)))


STEP_DIR = re.compile(r"^step-\d{12}-[0-9a-f]{8}$")
"""The name of a checkpoint's directory (`file_spec.checkpoint_id`: its step and its job's
attempt id); nothing else under a checkpoint directory is ever taken for a torn one."""


def _dir_step(name: str) -> int | None:
    match = re.match(r"^step-(\d+)", name)
    return int(match.group(1)) if match else None


def retire_after(root: str, start: int) -> tuple[list[int], list[str], list[str]]:
    """A run chose to start at step `start` (`--resume STEP`, or `none`: 0) under newer committed
    checkpoints: delete their manifests, the timeline it replaces, newest first. Left in place
    they would stay the newest (a relaunch or rollback would resume them, and retention would
    delete this run's own checkpoints as older), and their increments could be layered on steps
    this run rewrites. A manifest that cannot be read is left alone (reported as before), and
    so are the chains while one is (as `leftovers` does). Returns (the retired steps, the
    manifests that could not be deleted, with why, the folders under `root` no remaining
    manifest needs: `remove_folders`'s). Local (rank 0)."""
    try:
        manifests = list_manifests(root)
        unread = manifest_steps(root) - {m.step for m in manifests}
    except OSError as e:
        return [], [f"{root}: {e}"], []
    gone, kept = [], []
    for m in sorted((m for m in manifests if m.step > start), key=lambda m: -m.step):
        try:
            os.remove(manifest_path(root, m.step))
        except FileNotFoundError:
            pass
        except OSError as e:
            kept.append(f"{manifest_path(root, m.step)}: {e}")
            continue
        gone.append(m)
    if not gone:
        return [], kept, []
    try:
        fsync_path(root)
    except OSError:
        pass  # a crash before the folder is synced may bring a removed manifest back
    folders = referenced_dirs(gone) - referenced_dirs([m for m in manifests if m not in gone])
    if unread:
        folders = {d for d in folders if not d.startswith("chains/")}
    return sorted(m.step for m in gone), kept, sorted(folders)


def remove_folders(root: str, folders: list[str], say=None) -> None:
    """Delete checkpoint folders under `root` (already gone ones are fine); one line through
    `say` per folder that could not be deleted. Local."""
    for d in folders:
        try:
            shutil.rmtree(os.path.join(root, d))
        except FileNotFoundError:
            pass
        except OSError as e:
            if say is not None:
                say(f"could not delete {os.path.join(root, d)}: {e}")


def apply_retention(root: str, keep: int) -> list[int]:
    """Keep the newest `keep` committed checkpoints and every checkpoint they build on; delete the
    other manifests first, then every directory no retained manifest needs. Returns the deleted steps. Local (rank 0)."""
    manifests = list_manifests(root)
    if keep <= 0 or len(manifests) <= keep:
        return []
    retained = with_parents(manifests[-keep:], manifests)
    kept = {m.step for m in retained}
    retired = [m for m in manifests if m.step not in kept]
    for m in retired:
        os.remove(manifest_path(root, m.step))
    fsync_path(root)
    needed = referenced_dirs(retained)
    for d in referenced_dirs(retired) - needed:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    return [m.step for m in retired]

"""Catalog: what a checkpoint root holds, and how sound each checkpoint looks from the outside.

Only directory listings, manifests and file sizes are read here (no HDF5, no checksums), so listing a
root is fast however large its checkpoints are. Local: nothing here uses MPI.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from mpickpt.store import leftovers
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import MANIFEST_RE, Manifest, load_manifest, torn_dirs

STEP_DIR_RE = re.compile(r"^step-(\d+)")


class NoSuchCheckpoint(LookupError):
    """The root or the requested step does not exist (a usage error, not a damaged checkpoint)."""


@dataclass
class Catalog:
    """Everything found under one checkpoint root."""

    root: str
    manifests: list[Manifest] = field(default_factory=list)
    """Readable manifests, oldest step first."""
    bad_manifests: list[tuple[int, str]] = field(default_factory=list)
    """(step from the file name, message naming the file) of every unreadable manifest."""
    torn: list[str] = field(default_factory=list)
    """`step-*` directories no readable manifest refers to."""
    leftovers: list = field(default_factory=list)
    """What killed jobs left (`store.leftovers.Leftover`): removed by the next run, except stale
    survivor dumps (removed by a relaunch with survivor dumps on; `Leftover.by` says)."""

    def steps(self) -> list[int]:
        return [m.step for m in self.manifests]


def scan(root: str) -> Catalog:
    """Read every manifest under `root`; NoSuchCheckpoint when `root` is not a directory. Local."""
    if not os.path.isdir(root):
        what = "is not a directory" if os.path.exists(root) else "does not exist"
        raise NoSuchCheckpoint(f"{root}: checkpoint directory {what}")
    cat = Catalog(root)
    for name in sorted(os.listdir(root)):
        if MANIFEST_RE.match(name):
            try:
                cat.manifests.append(load_manifest(os.path.join(root, name)))
            except ValueError as e:
                cat.bad_manifests.append((int(MANIFEST_RE.match(name).group(1)), str(e)))
    cat.manifests.sort(key=lambda m: m.step)
    cat.torn = torn_dirs(root, cat.manifests)
    cat.leftovers = leftovers.find(root, cat.manifests, chains=not cat.bad_manifests)
    cat.leftovers += leftovers.stale_dumps(root, cat.steps()[-1] if cat.manifests else None)
    return cat


def file_problems(root: str, manifest: Manifest, paths=None) -> list[tuple[str, str]]:
    """(relative path, 'missing' | 'size mismatch') of every listed file (of `paths`, relative
    paths it lists; None: all) that is not as recorded. Local; sizes only, no file is opened."""
    out = []
    for rel in sorted(manifest.files) if paths is None else paths:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            out.append((rel, "missing"))
        elif os.path.getsize(path) != manifest.files[rel]["size"]:
            out.append((rel, "size mismatch"))
    return out


def missing_message(path: str, step: int) -> str:
    """What is said of a missing file of checkpoint `step`. Local."""
    return f"{path}: file of checkpoint step {step} is missing"


def file_problem_messages(root: str, manifest: Manifest, paths=None) -> list[str]:
    """`file_problems` as messages naming the full path, the sizes and the step. Local."""
    out = []
    for rel, kind in file_problems(root, manifest, paths):
        path, want = os.path.join(root, rel), manifest.files[rel]["size"]
        if kind == "missing":
            out.append(missing_message(path, manifest.step))
        else:
            out.append(f"{path}: {os.path.getsize(path)} bytes, the manifest of step "
                       f"{manifest.step} records {want} (truncated or overwritten)")
    return out


def status(root: str, manifest: Manifest) -> str:
    """'committed', or 'damaged (<problem>: <file>; ...)' from existence and sizes only. Local."""
    problems = file_problems(root, manifest)
    if not problems:
        return "committed"
    return "damaged (" + "; ".join(f"{kind}: {rel}" for rel, kind in problems) + ")"


def dir_step(name: str) -> int | None:
    """The step encoded in a `step-<12 digits>-<id>` directory name, or None. Local."""
    match = STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def dir_usage(path: str) -> tuple[int, int]:
    """(number of files, total bytes) directly inside `path`. Local."""
    files = [os.path.join(path, n) for n in os.listdir(path)]
    sizes = [os.path.getsize(p) for p in files if os.path.isfile(p)]
    return len(sizes), sum(sizes)


def listing(cat: Catalog) -> list[dict]:
    """One row per committed checkpoint and per torn directory, sorted by step. Local."""
    rows = [{"step": m.step, "kind": m.kind, "world_size": m.world_size, "files": len(m.files),
             "bytes": int(m.stats.get("bytes", m.total_bytes())), "status": status(cat.root, m),
             "ckpt_id": m.ckpt_id, "parents": list(m.parents)}
            for m in cat.manifests]
    rows += [{"step": step, "kind": None, "world_size": None, "files": 0, "bytes": 0,
              "status": "unreadable manifest", "ckpt_id": None} for step, _ in cat.bad_manifests]
    for d in cat.torn:
        nfiles, nbytes = dir_usage(os.path.join(cat.root, d))
        rows.append({"step": dir_step(d), "kind": None, "world_size": None, "files": nfiles,
                     "bytes": nbytes, "status": "torn (no manifest)", "ckpt_id": d})
    rows = sorted(rows, key=lambda r: (r["step"] is None, r["step"] or 0, r["kind"] is None))
    return rows + [{"step": None, "kind": None, "world_size": None, "files": 1,
                    "bytes": item.bytes, "status": f"leftover: {item.why} "
                    f"({os.path.relpath(item.path, cat.root)}; {item.by})",
                    "ckpt_id": None} for item in cat.leftovers]


def select(cat: Catalog, step: int | None, problems=None) -> tuple[Manifest, str | None]:
    """The manifest of `step`, or by default the newest whose manifest reads and whose files are
    all present and complete (`problems(root, manifest)`, the list of what is wrong with it:
    by default `file_problem_messages`, the listed files' existence and sizes).

    Returns (manifest, note); the note says when newer checkpoints were passed over (a damaged
    manifest, missing or truncated files) or when no sound one exists and the newest is returned
    anyway. CheckpointError naming the file when the manifest of `step` is damaged, or when every
    manifest is; NoSuchCheckpoint when there is nothing to choose. Local."""
    damaged = dict(cat.bad_manifests)
    if step is not None and step in damaged:
        raise CheckpointError(f"checkpoint step {step} cannot be used: {damaged[step]}")
    if not cat.manifests and damaged:
        raise CheckpointError(f"{cat.root}: no readable manifest: " + "; ".join(damaged.values()))
    if not cat.manifests:
        raise NoSuchCheckpoint(f"{cat.root}: no committed checkpoint (no readable manifest-*.json)")
    if step is not None:
        for m in cat.manifests:
            if m.step == step:
                return m, None
        steps = ", ".join(str(s) for s in cat.steps())
        raise NoSuchCheckpoint(f"{cat.root}: no committed checkpoint at step {step}; "
                               f"committed steps: {steps}")
    chosen, passed, note = _newest_sound(cat, problems or file_problem_messages)
    why = {**{s: damaged[s] for s in damaged if s > chosen.step}, **passed}
    skipped = [f"skipped checkpoint step {s}: {why[s]}" for s in sorted(why, reverse=True)]
    if skipped:
        note = "; ".join(skipped) + (f"; {note}" if note else f"; using step {chosen.step}")
    return chosen, note


def _newest_sound(cat: Catalog, problems) -> tuple[Manifest, dict[int, str], str | None]:
    """(the newest checkpoint without `problems`, what is wrong with each newer one by step,
    None), or (the newest, {}, a note) where every one has problems. Local."""
    passed: dict[int, str] = {}
    for m in reversed(cat.manifests):
        found = problems(cat.root, m)
        if not found:
            return m, passed, None
        passed[m.step] = "; ".join(found)
    newest = cat.manifests[-1]
    return newest, {}, (f"no checkpoint has all its files intact; using the newest, step "
                        f"{newest.step}")

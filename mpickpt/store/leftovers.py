"""Leftovers: what killed jobs leave in a checkpoint directory, found, explained and removed.

A rank or writer killed in the middle of a write leaves temporaries: a manifest being published
(``.manifest-<step>.json.tmp-<pid>``), part files and their disk reservations (``*.h5.tmp``,
``*.reserve``) in a step or chain directory, IncrCP bundles and index generations being written.
A whole chain directory can outlive every checkpoint of it (its checkpoints were retired before the
extractor's last collection ran, or its baseline never committed). None of them is ever read: the
manifest and the chunk index name every file a checkpoint uses. `find` lists them with the reason;
the next run removes them at its start (`remove`, on one rank, before any writer of its own has
started) and `mpickpt ls` shows what is left. Step directories without a manifest are handled
where they always were (`manifest.torn_dirs`). A temporary whose writer process is still alive on
this host is left alone. Local: nothing here uses MPI.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

_MANIFEST_TMP = re.compile(r"^\.manifest-\d{12}\.json\.tmp-(\d+)$")
_PID_TMP = re.compile(r"\.tmp-(\d+)$")
TEMP_SUFFIXES = (".tmp", ".reserve")


@dataclass(frozen=True)
class Leftover:
    """One path nothing will ever read, with its size and why it is there."""

    path: str
    bytes: int
    why: str


def find(root: str, manifests, chains: bool = True) -> list[Leftover]:
    """Leftovers under `root` given its committed (readable) manifests; `chains=False` leaves
    unused chain directories out (while a damaged manifest may be the one that used one). Local."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        match = _MANIFEST_TMP.match(name)
        if match and not _alive(match.group(1)):
            out.append(_file(root, name, f"a manifest write interrupted (process "
                                         f"{match.group(1)} is gone)"))
    committed = {m.ckpt_id for m in manifests}
    for d in sorted(committed):
        out += _temporaries(os.path.join(root, d), "an interrupted write in a committed checkpoint")
    chains = os.path.join(root, "chains")
    used = {m.chain for m in manifests if m.chain}
    for chain in sorted(os.listdir(chains)) if os.path.isdir(chains) else []:
        path = os.path.join(chains, chain)
        if chain not in used:
            if not chains:
                continue
            out.append(Leftover(path, _tree_bytes(path), "an IncrCP chain no committed checkpoint "
                                                         "uses"))
            continue
        for rank_dir in sorted(os.listdir(path)):
            out += _temporaries(os.path.join(path, rank_dir), "an interrupted write in a chain")
    return out


def remove(leftovers: list[Leftover]) -> int:
    """Delete them; returns the bytes freed. Local (one rank)."""
    freed = 0
    for item in leftovers:
        try:
            if os.path.isdir(item.path):
                shutil.rmtree(item.path)
            else:
                os.remove(item.path)
            freed += item.bytes
        except FileNotFoundError:
            pass
    return freed


def _temporaries(folder: str, why: str) -> list[Leftover]:
    if not os.path.isdir(folder):
        return []
    out = []
    for name in sorted(os.listdir(folder)):
        pid = _PID_TMP.search(name)
        if pid and _alive(pid.group(1)):
            continue
        if name.endswith(TEMP_SUFFIXES) or pid:
            out.append(_file(folder, name, why))
    return out


def _file(folder: str, name: str, why: str) -> Leftover:
    path = os.path.join(folder, name)
    try:
        size = os.path.getsize(path) if os.path.isfile(path) else _tree_bytes(path)
    except OSError:
        size = 0
    return Leftover(path, size, why)


def _tree_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


def _alive(pid: str) -> bool:
    """A process of that id exists on this host (it may still be writing). Local."""
    return os.path.exists(f"/proc/{pid}")

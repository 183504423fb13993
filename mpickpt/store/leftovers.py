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
this host is left alone.

Survivor dumps copied to ``<root>/survivors/rank-<r>`` (`--survivor-dumps ckpt`) are only listed
(`stale_dumps`, for `mpickpt ls`): one no newer than the newest committed checkpoint, left by an
earlier job of a directory made anew, or cut short is never used, but it is the survivors' code
that removes them (a relaunch with survivor dumps on, once it has decided not to use them), so the
restore here never deletes one. Local: nothing here uses MPI.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass

from mpickpt.owned_names import running

_MANIFEST_TMP = re.compile(r"^\.manifest-\d{12}\.json\.tmp-(\d+)$")
_REPLACING_TMP = re.compile(r"^\.mpickpt-replacing\.tmp-(\d+)$")  # `store.replacing`'s
_PID_TMP = re.compile(r"\.tmp-(\d+)$")
_ASIDE = re.compile(r"^step-\d{12}-[0-9a-f]{8}\.abandoned-(\d+)(?:-\d+)?$")  # `set_aside`'s
TEMP_SUFFIXES = (".tmp", ".reserve")
NEXT_RUN = "the next run removes it"
SURVIVORS = "survivors"
"""``<root>/survivors/rank-<r>``: where `survivors.dump` copies a rank's dump (with its
``header.json``); the root's lineage id is in `LINEAGE_FILE`. Both names are defined here and
imported by `survivors.dump` (the store does not depend on the survivors package)."""
LINEAGE_FILE = ".mpickpt-lineage"
_DUMP = re.compile(r"^rank-\d{5}$")
_DUMP_TMP = re.compile(r"^rank-\d{5}\.tmp-(\d+)$")
DUMP_REMOVER = "a relaunch with --survivor-dumps shm|ckpt removes it; safe to delete"


@dataclass(frozen=True)
class Leftover:
    """One path nothing will ever read, with its size and why it is there."""

    path: str
    bytes: int
    why: str
    by: str = NEXT_RUN
    """What removes it."""


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
        match = _REPLACING_TMP.match(name)
        if match and not _alive(match.group(1)):
            out.append(_file(root, name, f"a record of a chosen start interrupted (process "
                                         f"{match.group(1)} is gone)"))
        match = _ASIDE.match(name)
        if match and not _alive(match.group(1)):
            out.append(_file(root, name, f"an abandoned checkpoint whose removal was cut short "
                                         f"(process {match.group(1)} is gone)"))
    committed = {m.ckpt_id for m in manifests}
    for d in sorted(committed):
        out += _temporaries(os.path.join(root, d), "an interrupted write in a committed checkpoint")
    chains_dir = os.path.join(root, "chains")
    used = {m.chain for m in manifests if m.chain}
    for chain in sorted(os.listdir(chains_dir)) if os.path.isdir(chains_dir) else []:
        path = os.path.join(chains_dir, chain)
        if chain not in used:
            if not chains:
                continue
            out.append(Leftover(path, tree_bytes(path), "an IncrCP chain no committed checkpoint "
                                                         "uses"))
            continue
        for rank_dir in sorted(os.listdir(path)):
            out += _temporaries(os.path.join(path, rank_dir), "an interrupted write in a chain")
    return out


def set_aside(path: str, tries: int = 100) -> str | None:
    """Rename the directory of an abandoned checkpoint to a name no checkpoint takes
    (``<name>.abandoned-<pid>-<n>``, the first free n: the same step may be set aside again
    before an earlier copy is gone), which `find` lists once this process is gone, so that it
    can be deleted at leisure while a checkpoint of the same name is written anew. Its new
    path; `path` itself where no rename succeeds (the caller must delete it before anything
    writes there again); None when there is none to move. Local."""
    for n in range(tries):
        aside = f"{path}.abandoned-{os.getpid()}-{n}"
        try:
            os.rename(path, aside)
            return aside
        except FileNotFoundError:
            return None
        except OSError:  # most often: that name holds an earlier copy not deleted yet
            if not os.path.exists(aside):
                return path  # another cause: no other name will do better
    return path


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
        size = os.path.getsize(path) if os.path.isfile(path) else tree_bytes(path)
    except OSError:
        size = 0
    return Leftover(path, size, why)


def tree_bytes(path: str) -> int:
    """The bytes of every file under the folder `path` (files removed meanwhile count 0; a
    missing folder holds 0). Local."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


def _alive(pid: str) -> bool:
    """A process of that id runs on this host (it may still be writing). Local."""
    return running(int(pid))


def stale_dumps(root: str, newest_step: int | None) -> list[Leftover]:
    """Survivor dumps under ``<root>/survivors`` that no relaunch will use: a dump no newer than
    `newest_step` (the newest committed checkpoint), one of an earlier lineage of the directory,
    one whose header cannot be read, and the halves of a write whose process is gone. Only the
    headers are read (no array is checked). Listed, never removed here. Local."""
    folder = os.path.join(root, SURVIVORS)
    if not os.path.isdir(folder):
        return []
    current = _read_text(os.path.join(root, LINEAGE_FILE))
    out = []
    for name in sorted(os.listdir(folder)):
        tmp = _DUMP_TMP.match(name)
        if tmp and not _alive(tmp.group(1)):
            why = f"a survivor dump write interrupted (process {tmp.group(1)} is gone)"
        elif _DUMP.match(name):
            why = _stale_dump(os.path.join(folder, name), newest_step, current)
        else:
            why = None
        if why:
            item = _file(folder, name, why)
            out.append(Leftover(item.path, item.bytes, why, DUMP_REMOVER))
    return out


def _stale_dump(path: str, newest_step: int | None, lineage: str | None) -> str | None:
    """Why the dump at `path` will not be used, or None when a relaunch may use it. Local."""
    try:
        with open(os.path.join(path, "header.json")) as f:
            header = json.load(f)
        step = int(header["step"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        return f"a survivor dump whose header cannot be read ({e})"
    if lineage is not None and header.get("lineage", "") != lineage:
        return "a survivor dump left by an earlier job (the directory was made anew since)"
    if newest_step is not None and step <= newest_step:
        return (f"a survivor dump of step {step}, no newer than the newest committed checkpoint "
                f"(step {newest_step})")
    return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None

"""Committed checkpoints a restore could not use, set aside under ``<root>/unusable/``.

A restore that falls back past a checkpoint whose files fail (a flipped byte, a truncated or
missing file) resumes an older step and trains past it. Left among the committed checkpoints,
the unusable one would stay the newest: retention would count it among the checkpoints it
keeps and delete the run's own new ones as older, and a relaunch would try it first (and, were
the fault passing, resume a timeline the run left). So rank 0 moves it out of the committed
set once the older restore has succeeded: its manifest first (from then on it is no committed
checkpoint), then its own directory. Nothing is deleted: a checkpoint unreadable because of a
passing fault (an NFS hiccup) can be inspected, or moved back by hand. Chunks an IncrCP
checkpoint shares with its chain stay with the chain, which no restore removes as a leftover
while anything is set aside here.

Layout: ``unusable/<name>.manifest.json`` (the manifest as it was) and ``unusable/<name>/`` (its
directory), where the name is the checkpoint's id (``.<n>`` added where it is taken). Local:
nothing here uses MPI.
"""
from __future__ import annotations

import os

from mpickpt.store.durable import fsync_path
from mpickpt.store.manifest import Manifest, manifest_path

FOLDER = "unusable"
SUFFIX = ".manifest.json"


def folder_of(root: str) -> str:
    return os.path.join(root, FOLDER)


def set_aside(root: str, manifest: Manifest) -> str:
    """Move `manifest`'s checkpoint out of `root`'s committed set into ``unusable/`` (its
    manifest, then its own directory where there is one, then both folders synced); the
    folder it went to. OSError when either cannot move: the checkpoint then stays committed,
    its manifest put back where its directory could not follow. Local (rank 0)."""
    folder = folder_of(root)
    os.makedirs(folder, exist_ok=True)
    name = _free_name(folder, manifest.ckpt_id)
    committed, aside = manifest_path(root, manifest.step), os.path.join(folder, name + SUFFIX)
    own = os.path.join(root, manifest.ckpt_id)
    os.replace(committed, aside)
    try:
        if os.path.isdir(own):
            os.replace(own, os.path.join(folder, name))
        fsync_path(folder)
        fsync_path(root)
    except OSError:  # the manifest goes back: a directory left without it would be torn,
        if not os.path.isdir(os.path.join(folder, name)):  # and deleted as such
            os.replace(aside, committed)
        raise
    return folder


def _free_name(folder: str, ckpt_id: str) -> str:
    """`ckpt_id`, or ``<ckpt_id>.<n>`` for the first n free, where a checkpoint of that id was
    set aside before (a job's relaunches write the same ids). Local."""
    n, name = 0, ckpt_id
    while os.path.lexists(os.path.join(folder, name + SUFFIX)) or \
            os.path.lexists(os.path.join(folder, name)):
        n += 1
        name = f"{ckpt_id}.{n}"
    return name


def held(root: str) -> list[str]:
    """The checkpoint ids set aside under `root`, sorted (by step: ids begin with it). Local."""
    folder = folder_of(root)
    if not os.path.isdir(folder):
        return []
    return sorted(name[:-len(SUFFIX)] for name in os.listdir(folder) if name.endswith(SUFFIX))

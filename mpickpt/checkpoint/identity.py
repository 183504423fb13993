"""A checkpoint file's identity: the step (and, for a rank's files, the rank, part and world size)
its root attributes name, against the manifest that lists it.

A file is sound on its own when its blocks pass their checksums and its attributes their digest;
a file of another checkpoint copied over one of the same size passes both, and so does the
manifest's size check. Its attributes still say which checkpoint wrote it. `verify` compares
the whole-file CRC too; a restore and an export compare the attributes of every listed file
they open (`IdentityCheck`), which costs nothing: they read those attributes anyway. Local:
nothing here uses MPI.
"""
from __future__ import annotations

import os

from mpickpt.store import h5_lowlevel
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest, parent_manifests
from mpickpt.store.shard_file import open_shard


def identity_problems(path: str, attr, meta: dict, manifest: Manifest) -> list[str]:
    """The problems of a file `manifest` lists (`meta`: its entry there) whose root attribute
    of a name is `attr(name)` (None where it has none): its step, and for a shard (a rank's
    rows) its rank, part and world size, or for an extra file (a rank's RNG states) its rank,
    must be the manifest's. Local."""
    want = {"step": manifest.step}
    if meta.get("role") == "shard":
        want.update(world_size=manifest.world_size, rank=meta.get("rank"), part=meta.get("part"))
    elif meta.get("role") == "extra":
        want["rank"] = meta.get("rank")
    found = {key: attr(key) for key, value in want.items() if value is not None}
    return [f"{path}: attribute {key}={_plain(found[key])!r}, the manifest of step "
            f"{manifest.step} says {want[key]!r} (a file of another checkpoint?)"
            for key in found if found[key] != want[key]]


def _plain(value):
    """numpy scalars as Python numbers, for messages. Local."""
    return value.item() if hasattr(value, "item") else value


class IdentityCheck:
    """`identity_problems` for the files of `manifest` and of the manifests it builds on, by
    absolute path; a callable for `OpenShards(check=...)` that raises CheckpointError. Files no
    manifest lists (IncrCP's chain files, with their own index) pass. Local."""

    def __init__(self, root: str, manifest: Manifest, by_step: dict[int, Manifest]):
        self.listed: dict[str, tuple[Manifest, dict]] = {}
        for m in [*parent_manifests(manifest, by_step), manifest]:
            for rel, meta in m.files.items():
                self.listed[os.path.join(root, rel)] = (m, meta)

    def __call__(self, path: str, f) -> None:
        owner = self.listed.get(path)
        if owner is None:
            return
        problems = identity_problems(path, lambda key: h5_lowlevel.read_attr(f.id, key),
                                     owner[1], owner[0])
        if problems:
            raise CheckpointError("; ".join(problems))

    def check_all(self) -> None:
        """Open every listed file once and check it (for readers that open them elsewhere, e.g.
        an export). Local."""
        for path in self.listed:
            with open_shard(path) as f:
                self(path, f)

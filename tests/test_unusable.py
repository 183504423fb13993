"""`store.unusable`: a committed checkpoint a restore fell back past leaves the committed set
whole, or not at all (in process, real files)."""
import os
from types import SimpleNamespace

import pytest

from mpickpt.store import unusable


def _committed(root, step=60):
    m = SimpleNamespace(step=step, ckpt_id=f"step-{step:012d}-0000abcd")
    with open(os.path.join(root, f"manifest-{step:012d}.json"), "w") as f:
        f.write("{}")
    os.makedirs(os.path.join(root, m.ckpt_id))
    return m


def test_a_checkpoint_set_aside_twice_keeps_both_copies(tmp_path):
    root = str(tmp_path)
    for _ in range(2):
        unusable.set_aside(root, _committed(root))
    assert unusable.held(root) == ["step-000000000060-0000abcd", "step-000000000060-0000abcd.1"]
    assert sorted(os.listdir(root)) == ["unusable"]


def test_a_directory_that_cannot_follow_its_manifest_keeps_both_committed(tmp_path,
                                                                          monkeypatch):
    """The manifest moved, the directory could not: the manifest goes back, or the directory
    would be taken for a torn one and deleted."""
    root = str(tmp_path)
    m = _committed(root)
    real = os.replace

    def refuse_directories(a, b):
        if os.path.isdir(a):
            raise PermissionError(13, "Permission denied", a)
        return real(a, b)

    monkeypatch.setattr(os, "replace", refuse_directories)
    with pytest.raises(PermissionError):
        unusable.set_aside(root, m)
    monkeypatch.setattr(os, "replace", real)
    assert sorted(os.listdir(root)) == ["manifest-000000000060.json", m.ckpt_id, "unusable"]
    assert unusable.held(root) == []

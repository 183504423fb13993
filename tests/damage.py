"""Deliberate damage to committed checkpoints, for the integrity tests."""
import os
import re


def edit_reader_position(root: str, step: int) -> str:
    """Add one to the reader position recorded in the manifest of `step` (its checksum left as
    it was); returns the manifest's path."""
    path = os.path.join(root, f"manifest-{step:012d}.json")
    text = open(path).read()
    edited = re.sub(r'"sample_index": (\d+)', lambda m: f'"sample_index": {int(m.group(1)) + 1}',
                    text, count=1)
    assert edited != text
    with open(path, "w") as f:
        f.write(edited)
    return path

"""Sealed JSON records (manifests, chunk indexes): what is written reads back unchanged, with a
checksum of the canonical form whichever way the text was laid out, and a changed value is
refused naming the file."""
import json

import pytest

from mpickpt.store.sealed_json import (DamagedRecord, content_checksum, dumps_sealed,
                                       read_sealed)

RECORD = {"version": 2, "chain": "chain-000000000050-a5eaec35", "rank": 1, "generation": 7,
          "columns": [50, 100], "stats": {"last": {"seconds": 0.25, "bloom": False}},
          "cells": {"0": {"50": [[{"file": "chains/x/col.h5", "start": 0, "stop": 32,
                                   "until": None}], []]}}, "nan": float("nan")}


@pytest.mark.parametrize("indent", [None, 1])
@pytest.mark.parametrize("record", [RECORD, {}, {"checksum": "sha256:stale", "a": [1]}])
def test_a_sealed_record_reads_back_as_written(tmp_path, record, indent):
    path = tmp_path / "r.json"
    text = dumps_sealed(record, indent=indent)
    path.write_text(text)
    parsed = json.loads(text)
    body = {k: v for k, v in record.items() if k != "checksum"}
    assert parsed["checksum"] == content_checksum(body) != "sha256:stale"
    got = read_sealed(str(path), "version", 2)
    assert json.dumps(got, sort_keys=True) == json.dumps(body, sort_keys=True)
    assert (text.count("\n") > 0) == bool(indent)


@pytest.mark.parametrize("indent", [None, 1])
def test_a_changed_value_is_refused_naming_the_file(tmp_path, indent):
    path = tmp_path / "index-00000007.json"
    sep = ": " if indent else ":"
    text = dumps_sealed(RECORD, indent=indent)
    assert f'"generation"{sep}7,' in text
    path.write_text(text.replace(f'"generation"{sep}7,', f'"generation"{sep}8,'))
    with pytest.raises(DamagedRecord, match=f"{path}: content fails its checksum"):
        read_sealed(str(path), "version", 2)

"""bench/quant_codecs.py runs end to end on a small random matrix and writes sound results."""
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quant_codecs_bench_writes_results(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "quant_codecs.py"), "--rows", "2000",
                           "--skip-trained", "--repeats", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "quant_codecs.png").stat().st_size > 0
    doc = json.loads((tmp_path / "quant_codecs.json").read_text())
    assert list(doc["matrices"]) == ["random"]
    m = doc["matrices"]["random"]
    assert m["info"]["rows"] == 2000 and m["info"]["dim"] == 64
    results = m["results"]
    for bits in (2, 4):
        keys = [f"adaptive-{s}-{bits}-t{t}" for s in ("refined", "greedy") for t in (1, 2)]
        keys += [f"fbgemm-{k}-{bits}-t{t}" for k in ("naive", "greedy") for t in (1, 2)]
        for key in keys:
            r = results[key]
            for field in ("l2", "rows_per_s", "bytes_per_row", "encode_s"):
                assert math.isfinite(r[field]) and r[field] > 0, (key, field, r[field])
        for t in (1, 2):
            ratio = m["ratios"][f"{bits}bit-t{t}"]
            assert math.isfinite(ratio["l2_ratio"]) and ratio["l2_ratio"] > 0
            assert math.isfinite(ratio["speedup"]) and ratio["speedup"] > 0
    for bits in (2, 3, 4, 8):
        for t in (1, 2):
            assert results[f"adaptive-refined-{bits}-t{t}"]["l2"] <= results[f"asym-{bits}"]["l2"]
    assert set(doc["targets_hold"]) == {"l2", "bytes", "speed"}
    assert doc["machine"]["torch"]

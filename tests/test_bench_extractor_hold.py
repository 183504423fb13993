"""bench/extractor_hold.py runs in-process on small tables and reports what each limit did."""
import json

from tests.bench_module import load_bench


def test_extractor_hold_bench_holds_only_under_a_nonzero_limit(tmp_path, capsys):
    bench = load_bench("extractor_hold")
    out = tmp_path / "hold.json"
    assert bench.main(["--scale-down", "2000", "--ingestions", "4", "--skip", "1", "--batches",
                       "4", "--rounds", "1", "--dir", str(tmp_path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    held = {s["hold"]: s["held_last"] for s in doc["summary"]}
    assert held == {"0": False, "64M": True, "512M (default)": True}
    assert all(0 < s["last_row0_mb"] <= s["bundle_mb_median"] * 3 for s in doc["summary"])
    assert len(doc["runs"]) == 3
    for run in doc["runs"]:
        assert run["cpu_ms_median"] > 0 and run["bundle_mb_median"] > 0
    assert "| 0 | " in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hold-")]  # chains removed

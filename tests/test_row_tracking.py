"""The modified-row bit-vector marks exactly the rows it is given, on CPU and (when present) GPU."""
import subprocess
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpickpt.track.bitvector import RowBitVector

KERNEL = Path(__file__).resolve().parents[1] / "kernels" / "row_tracking.cu"


@settings(max_examples=80, deadline=None)
@given(num_rows=st.integers(1, 1000), data=st.data())
def test_marks_exactly_the_union_of_batches(num_rows, data):
    bv = RowBitVector(num_rows)
    batches = data.draw(st.lists(st.lists(st.integers(0, num_rows - 1), max_size=60), max_size=5))
    for rows in batches:
        bv.mark(torch.tensor(rows, dtype=torch.int64))
    expected = sorted({r for rows in batches for r in rows})
    assert bv.count() == len(expected)
    assert bv.extract().tolist() == expected
    assert bv.extract().tolist() == []  # read-and-clear


def test_word_edges_and_memory():
    bv = RowBitVector(200)
    rows = torch.tensor([0, 63, 64, 127, 128, 191, 199, 63, 63])
    bv.mark(rows)
    assert bv.extract(clear=False).tolist() == [0, 63, 64, 127, 128, 191, 199]
    assert bv.words[0].item() == (1 | -(1 << 63))  # bit 63 is the sign bit of the word
    assert bv.nbytes == 32  # 200 rows -> 4 words: at most one bit per row, rounded to words


def test_nvcc_compiles_the_kernel(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    out = tmp_path / "row_tracking.cubin"
    proc = subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", "--cubin", "-o", str(out),
                           str(KERNEL)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and CuPy")
def test_cuda_kernels_match_cpu():
    pytest.importorskip("cupy")
    g = torch.Generator().manual_seed(0)
    cpu, gpu = RowBitVector(100_003), RowBitVector(100_003, device="cuda")
    for _ in range(5):
        rows = torch.randint(0, 100_003, (20_000,), generator=g)
        cpu.mark(rows)
        gpu.mark(rows.cuda())
    assert torch.equal(gpu.extract().cpu(), cpu.extract())

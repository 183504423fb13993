"""A bit-vector of modified rows: one bit per local row, packed into 64-bit words.

Rows are marked where the owner receives its indices in the forward all-to-all (every received
row gets a gradient and an optimizer update in the same step), and read-and-cleared at a snapshot.
The CPU path marks in vectorized torch and extracts with `bit_rows` (a walk of the words); on CUDA
the same words live on the GPU and the CuPy kernels in `kernels/row_tracking.cu` mark them with
atomicOr on a side stream, so marking overlaps the pooled-embedding all-to-all.
"""
from __future__ import annotations

import torch

from mpickpt.track.bit_rows import set_rows

WORD_BITS = 64


def num_words(num_rows: int) -> int:
    """Words needed for `num_rows` bits. Local."""
    return -(-num_rows // WORD_BITS)


def _bit_values(device) -> torch.Tensor:
    """int64 value of each bit 0..63 (bit 63 is the sign bit). Local."""
    return torch.ones(WORD_BITS, dtype=torch.int64, device=device) << torch.arange(
        WORD_BITS, dtype=torch.int64, device=device)


class RowBitVector:
    """Modified-row bits of one rank's shard (CPU or CUDA tensor of int64 words)."""

    def __init__(self, num_rows: int, device=None, use_kernels: bool | None = None):
        self.num_rows = num_rows
        self.device = torch.device(device or "cpu")
        self.words = torch.zeros(num_words(num_rows), dtype=torch.int64, device=self.device)
        self._bits = _bit_values(self.device)
        if use_kernels is None:
            use_kernels = self.device.type == "cuda"
        self._kernels = _load_kernels() if use_kernels else None

    @property
    def nbytes(self) -> int:
        """Memory used by the bits (num_rows / 8, rounded up to words). Local."""
        return self.words.numel() * 8

    def mark(self, rows: torch.Tensor, sorted_unique: bool = False) -> None:
        """Set the bits of `rows` (int64 local rows). Local.

        Duplicates are allowed unless `sorted_unique` says the rows are already sorted and unique
        (as the embedding's index hook delivers them), which skips a sort."""
        if rows.numel() == 0:
            return
        if self._kernels is not None:
            self._kernels.mark(self.words, rows)
            return
        if not sorted_unique:
            rows = torch.unique(rows)  # sorted, so their words are sorted too
        words, inverse = torch.unique_consecutive(rows >> 6, return_inverse=True)
        # distinct bits of one word sum to their OR (bit 63 wraps to the sign bit, still exact)
        merged = torch.zeros(len(words), dtype=torch.int64, device=rows.device)
        merged.index_add_(0, inverse, self._bits[rows & 63])
        self.words[words] |= merged

    def count(self) -> int:
        """Number of set bits. Local."""
        return int(self.extract(clear=False).numel())

    def extract(self, clear: bool = True) -> torch.Tensor:
        """Sorted local rows whose bit is set; clears the bits unless `clear` is False. Local."""
        if self._kernels is not None:
            rows = self._kernels.extract(self.words, self.num_rows)
        elif self.device.type == "cpu":
            rows = torch.from_numpy(set_rows(self.words.numpy()))
        else:  # another device without the kernels: each non-zero word expanded into 64 lanes
            nz = torch.nonzero(self.words).flatten()
            set_bits = (self.words[nz].unsqueeze(1) & self._bits) != 0
            word_of, bit = torch.nonzero(set_bits, as_tuple=True)
            rows = nz[word_of] * WORD_BITS + bit
        if clear:
            self.words.zero_()
        return rows

    def attach(self, embeddings) -> callable:
        """Mark rows as `embeddings` receives them each step (its index hook). Local."""
        return embeddings.add_index_hook(lambda rows: self.mark(rows, sorted_unique=True))


def _load_kernels():
    from mpickpt.track.cuda_kernels import RowTrackingKernels

    return RowTrackingKernels()

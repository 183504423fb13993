"""DLRM's dense part: bottom MLP, dot interaction, top MLP. Replicated on every rank."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def parse_mlp(text: str, flag: str) -> tuple[int, ...]:
    """Parse '13-512-256-64' into layer widths, naming `flag` in the error. Local."""
    try:
        sizes = tuple(int(x) for x in str(text).split("-"))
    except ValueError:
        raise ValueError(f"{flag} must be dash-separated positive integers like 13-64-16, got {text!r}")
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"{flag} must be dash-separated positive integers like 13-64-16, got {text!r}")
    return sizes


@dataclass(frozen=True, kw_only=True, slots=True)
class DenseArch:
    """Shapes of the dense part. `bottom` includes its input width; `top` excludes it."""

    num_dense: int
    """Dense input features (13 for Criteo)."""
    num_tables: int
    """Embedding tables feeding the interaction."""
    dim: int
    """Embedding dimension (--arch-sparse-feature-size)."""
    bottom: tuple[int, ...]
    """Bottom MLP widths, input first: must start at num_dense and end at dim."""
    top: tuple[int, ...]
    """Top MLP widths after the interaction: must end at 1 (the logit)."""

    def __post_init__(self):
        if len(self.bottom) < 2 or self.bottom[0] != self.num_dense:
            raise ValueError(f"--arch-mlp-bot must start with the {self.num_dense} dense features and "
                             f"have at least two widths, got {'-'.join(map(str, self.bottom))}")
        if self.bottom[-1] != self.dim:
            raise ValueError(f"--arch-mlp-bot must end with the embedding dimension "
                             f"--arch-sparse-feature-size={self.dim}, got "
                             f"{'-'.join(map(str, self.bottom))}")
        if self.top[-1] != 1:
            raise ValueError(f"--arch-mlp-top must end with 1 (the logit), got "
                             f"{'-'.join(map(str, self.top))}")

    @property
    def interaction_width(self) -> int:
        """Width of [bottom output, pairwise dots of the T+1 vectors]."""
        n = self.num_tables + 1
        return self.dim + n * (n - 1) // 2


def _mlp(widths: tuple[int, ...], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRMDense(nn.Module):
    """Bottom MLP -> dot interaction with the pooled embeddings -> top MLP -> logit."""

    def __init__(self, arch: DenseArch):
        super().__init__()
        self.arch = arch
        self.bottom = _mlp(arch.bottom, last_activation=True)
        self.top = _mlp((arch.interaction_width, *arch.top), last_activation=False)
        n = arch.num_tables + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("_li", rows, persistent=False)
        self.register_buffer("_lj", cols, persistent=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits (B,) from dense features (B, num_dense) and pooled embeddings (B, T, dim). Local."""
        x = self.bottom(dense)
        z = torch.cat([x.unsqueeze(1), pooled], dim=1)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self._li, self._lj]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

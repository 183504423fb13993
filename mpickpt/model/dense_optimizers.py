"""Dense optimizers for the replicated MLPs: torch.optim's Adagrad and SGD updates, op for op,
without torch.optim.

torch.optim's `Optimizer.__init__` and every `step()` import `torch._dynamo` (through
`_disable_dynamo` and `_use_grad_for_differentiable`), 1.2-1.4 s per process here: about a third
of a trainer's start, and most of a respawned replacement's. These classes run the same
single-tensor update torch.optim runs on CPU (`_single_tensor_adagrad`, `_single_tensor_sgd`,
default arguments) and keep the same per-parameter state under the same keys ('step' and 'sum';
'momentum_buffer'), so a run is bit-identical to one with torch.optim on CPU and checkpoints carry
the same names either way. On CUDA, torch.optim would take its foreach path, whose Adagrad rounds
the step differently; these classes keep the single-tensor order there too, deterministically.
"""
from __future__ import annotations

from collections import defaultdict

import torch


class DenseOptimizer:
    """Common part: the parameters, `state` (parameter -> {key: tensor}, as torch.optim keeps it)
    and `zero_grad`. Local."""

    def __init__(self, params, lr: float):
        self.params = list(params)
        if not self.params:
            raise ValueError("a dense optimizer needs at least one parameter, got none")
        self.lr = float(lr)
        self.state: defaultdict[torch.Tensor, dict] = defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every parameter's gradient. Local."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()

    def _with_grad(self):
        return [p for p in self.params if p.grad is not None]

    def step(self) -> None:
        """One update of every parameter that has a gradient. Local."""
        raise NotImplementedError


class DenseAdagrad(DenseOptimizer):
    """Adagrad (lr_decay 0, weight_decay 0, initial accumulator 0): sum += g*g;
    p -= lr * g / (sqrt(sum) + eps); 'step' counts updates as a CPU scalar, as torch.optim's."""

    def __init__(self, params, lr: float, eps: float):
        super().__init__(params, lr)
        self.eps = float(eps)
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for p in self.params:  # torch.optim.Adagrad creates its state eagerly
            self.state[p]["step"] = torch.tensor(0.0, dtype=scalar)
            self.state[p]["sum"] = torch.full_like(p, 0.0, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self) -> None:
        for p in self._with_grad():
            state = self.state[p]
            state["step"] += 1
            state["sum"].addcmul_(p.grad, p.grad, value=1)
            std = state["sum"].sqrt().add_(self.eps)
            p.addcdiv_(p.grad, std, value=-self.lr)


class DenseSGD(DenseOptimizer):
    """SGD, with heavy-ball momentum when `momentum` > 0 (dampening 0, no Nesterov): the first
    step's buffer is the gradient itself, later ones buf = momentum * buf + g; p -= lr * buf."""

    def __init__(self, params, lr: float, momentum: float = 0.0):
        super().__init__(params, lr)
        self.momentum = float(momentum)

    @torch.no_grad()
    def step(self) -> None:
        for p in self._with_grad():
            grad = p.grad
            if self.momentum != 0:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad, alpha=1)
                grad = buf
            p.add_(grad, alpha=-self.lr)

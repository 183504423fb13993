"""The replicated (dense) part of a model's state as mpickpt saves it, the same for every model:
'param/<name>' for each parameter and 'opt/<i>/<key>' for each tensor of its optimizer's state
(i: the parameter's position). Local."""
from __future__ import annotations

import torch


def dense_state_of(named_params, optimizer) -> dict[str, torch.Tensor]:
    """`named_params`: (name, parameter) in a fixed order; `optimizer`: theirs, or None. Local;
    the tensors are live (detached), not copies."""
    named_params = list(named_params)
    out = {f"param/{n}": p.detach() for n, p in named_params}
    if optimizer is not None:
        for i, (_, p) in enumerate(named_params):
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"opt/{i}/{key}"] = value.detach()
    return out


def dense_mismatch(current: dict, arrays: dict) -> str | None:
    """How the saved dense state `arrays` (name -> array) differs from a model's `current`
    one (`dense_state_of`'s names -> tensors) in the names or shapes of its parameters and
    optimizer state: the first few differences, or None where it fits. Local."""
    def shape(value) -> tuple:
        return tuple(value.shape)

    saved = {n: shape(v) for n, v in arrays.items()}
    mine = {n: shape(v) for n, v in current.items()}
    params = sorted(n for n in set(saved) | set(mine) if n.startswith("param/"))
    problems = [f"{n[6:]} saved {_dims(saved.get(n))}, the model's {_dims(mine.get(n))}"
                for n in params if saved.get(n) != mine.get(n)]
    if not problems:  # the same parameters: optimizer state of another shape would not load
        problems = [f"optimizer state {n[4:]} saved {_dims(saved[n])}, the model's "
                    f"{_dims(mine[n])}" for n in sorted(set(saved) & set(mine))
                    if n.startswith("opt/") and saved[n] != mine[n]]
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def _dims(shape: tuple | None) -> str:
    return "nothing" if shape is None else "x".join(map(str, shape)) or "a scalar"


@torch.no_grad()
def load_dense_state_into(named_params, optimizer, arrays: dict) -> None:
    """Write `arrays` (as `dense_state_of` names them) into the parameters and the optimizer's
    state; ValueError naming the parameters missing, extra or of other shapes. Local."""
    named_params = list(named_params)
    params = dict(named_params)
    differs = dense_mismatch({f"param/{k}": v for k, v in params.items()},
                             {n: v for n, v in arrays.items() if n.startswith("param/")})
    if differs is not None:
        raise ValueError(f"dense state of other shapes: {differs}")
    order = [p for _, p in named_params]
    for name, value in arrays.items():
        kind, rest = name.split("/", 1)
        tensor = torch.as_tensor(value)
        if kind == "param":
            params[rest].copy_(tensor.to(params[rest].device))
        elif optimizer is not None:
            i, key = rest.split("/", 1)
            p = order[int(i)]
            state = optimizer.state[p]
            old = state.get(key)  # keep e.g. Adagrad's CPU 'step' where torch put it
            device = old.device if isinstance(old, torch.Tensor) else p.device
            state[key] = tensor.to(device).clone()

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


@torch.no_grad()
def load_dense_state_into(named_params, optimizer, arrays: dict) -> None:
    """Write `arrays` (as `dense_state_of` names them) into the parameters and the optimizer's
    state; ValueError naming the parameters missing. Local."""
    named_params = list(named_params)
    params = dict(named_params)
    needed = {f"param/{n}" for n in params}
    if not needed <= set(arrays):
        raise ValueError(f"dense state lacks {sorted(needed - set(arrays))}")
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

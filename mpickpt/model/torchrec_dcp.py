"""TorchRec models and torch.distributed.checkpoint (DCP), both ways, so users switch without
retraining.

- `save_dcp(model, path, step, reader)`: the model as a DCP checkpoint of what TorchRec users
  save: `"model"` is `dmp.state_dict()` (ShardedTensors of the tables, the dense parameters),
  `"fused_optimizer"` is `dmp.fused_optimizer.state_dict()` (the rows' optimizer state),
  `"dense_optimizer"` the dense optimizer's state by parameter name (`<fqn>/<key>`), and
  `"mpickpt"` the step and reader position as JSON (so an import resumes where the export stood).
  `dcp.load` of `{"model": dmp.state_dict()}` into any DMP of the same tables, under any plan
  or world size, reads it.
- `load_dcp(model, path)`: a DCP checkpoint of a DMP (these keys; `"model"` alone is enough)
  read into the model in place (DCP reshards); returns the step and reader position it
  carries, if any.

Both are collective over the model's process group.
"""
from __future__ import annotations

import json

import torch

META_KEY = "mpickpt"


def _dense_optimizer_state(model) -> dict[str, torch.Tensor]:
    """The dense optimizer's tensors by '<parameter fqn>/<key>'. Local; live tensors."""
    out = {}
    if model.dense_optimizer is not None:
        for name, p in model.dense_params:
            for key, value in model.dense_optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{name}/{key}"] = value
    return out


def _state(model, with_meta: str | None) -> dict:
    state = {"model": model.dmp.state_dict(),
             "fused_optimizer": model.dmp.fused_optimizer.state_dict(),
             "dense_optimizer": _dense_optimizer_state(model)}
    if with_meta is not None:
        state[META_KEY] = with_meta
    return state


def _holds_tensors(value) -> bool:
    """Whether a state (nested dicts and lists) holds any tensor: an empty one is a key DCP
    would look for and not find. Local."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


def save_dcp(model, path: str, step: int, reader: dict) -> None:
    """Write `model` (a TorchRecModel) as a DCP checkpoint at `path`. Collective."""
    import torch.distributed.checkpoint as dcp

    with model.state_lock:
        meta = json.dumps({"step": int(step), "reader": reader}, sort_keys=True)
        dcp.save(_state(model, meta), checkpoint_id=path, process_group=model.topo.pg)


def importable_entries(path: str) -> set[str]:
    """The top-level entries of the DCP checkpoint at `path` (its metadata only); ValueError
    naming it where it cannot be read or holds no `"model"` entry. Local."""
    import torch.distributed.checkpoint as dcp

    try:
        keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as e:  # a truncated or foreign .metadata file
        raise ValueError(f"{path}: its DCP metadata cannot be read ({e})") from None
    tops = {k.split(".", 1)[0] for k in keys}
    if "model" not in tops:
        raise ValueError(f"{path}: a DCP checkpoint without a 'model' entry (it holds "
                         f"{sorted(tops)}); expected dmp.state_dict() saved under 'model'")
    return tops


def load_dcp(model, path: str, say=None) -> dict | None:
    """Read the DCP checkpoint at `path` into `model` (tables, their fused optimizer state,
    the dense part and its optimizer, whichever it holds; `"model"` must be there). Optimizer
    state the model has nowhere to put (plain SGD, or an optimizer that makes its state at its
    first step) is not read, and `say` is told. Returns `{"step", "reader"}` when mpickpt wrote
    it, else None. Collective."""
    import torch.distributed.checkpoint as dcp

    tops = importable_entries(path)
    state = _state(model, "" if META_KEY in tops else None)
    for name in ("fused_optimizer", "dense_optimizer"):
        if name in tops and not _holds_tensors(state[name]) and say is not None:
            say(f"--import-dcp {path}: its {name} state is not loaded: this model's optimizer "
                f"holds none to load it into (plain SGD, or state made at the first step)")
        if name not in tops or not _holds_tensors(state[name]):
            state.pop(name)
    with model.state_lock:
        dcp.load(state, checkpoint_id=path, process_group=model.topo.pg)
        if "fused_optimizer" in state:
            model.dmp.fused_optimizer.load_state_dict(state["fused_optimizer"])
    return json.loads(state[META_KEY]) if META_KEY in state else None

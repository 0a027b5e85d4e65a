"""Run by tests/test_package.py in a fresh venv with the wheel installed, as
``python -I -W error tests/import_probe.py EXPECTED_PREFIX``: importing remat warns of
nothing and changes nothing in torch outside remat regions. Prints ``ok`` at the end.
"""

from __future__ import annotations

import importlib.metadata
import sys
import types
from typing import Any

import torch

# remat tells FSDP2 modules and DTensors by their classes, so `import remat` imports these
# two torch modules, which register torch's own distributed ops (c10d_functional, fsdp,
# symm_mem, _dtensor). They are imported first so that what remat adds shows alone.
import torch.distributed.fsdp
import torch.distributed.tensor
from torch.func import grad, jacrev, vjp, vmap
from torch.utils.checkpoint import checkpoint

REPLACED = {("torch.autograd.graph", "disable_saved_tensors_hooks")}  # by remat, on purpose


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(torch.tanh(x @ w), 0.25).exp().sum()


def _workload() -> dict[str, Any]:
    """Autograd, torch.func, torch's checkpoint and random ops, from a fixed seed."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    out: dict[str, Any] = {}
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = _block(xg, wg)
    (gx,) = torch.autograd.grad(loss, xg, create_graph=True)
    out["loss"] = loss.detach()
    out["autograd.grad"] = gx.detach()
    out["second order"] = torch.autograd.grad(gx.sum(), wg)[0]
    xc = x.clone().requires_grad_()
    checkpoint(_block, xc, w, use_reentrant=False).backward()
    out["torch checkpoint"] = xc.grad
    out["func.grad"] = grad(_block)(x, w)
    _, vjp_fn = vjp(lambda x: torch.tanh(x @ w), x)
    out["func.vjp"] = vjp_fn(torch.ones(4, 5, dtype=torch.float64))[0]
    out["func.jacrev"] = jacrev(lambda x: torch.tanh(x @ w))(x[0])
    out["vmap(grad)"] = vmap(grad(_block), in_dims=(0, None), randomness="same")(x[:, None], w)
    out["rng after"] = torch.get_rng_state()
    out["func.grad under hooks"] = "no error"
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        try:
            grad(_block)(x, w)
        except RuntimeError as error:  # torch.func refuses to start under pushed hooks
            out["func.grad under hooks"] = str(error)
    return out


def _torch_attributes() -> dict[tuple[str, str], Any]:
    """Every attribute of every imported torch module and of the classes most often patched."""
    found: dict[tuple[str, str], Any] = {}
    for name, module in list(sys.modules.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(module, types.ModuleType):
            found.update(((name, k), v) for k, v in list(vars(module).items()))
    classes = (torch._C.TensorBase, torch.Tensor, torch.UntypedStorage, torch.nn.Module)
    for cls in (*classes, torch.autograd.Function):
        found.update(((cls.__qualname__, k), v) for k, v in vars(cls).items())
    return found


def _changed(before: dict[tuple[str, str], Any], now: dict[tuple[str, str], Any]) -> set[Any]:
    """Attributes replaced, removed or added; a newly imported submodule is no change."""
    added = {k for k in now.keys() - before.keys() if not isinstance(now[k], types.ModuleType)}
    new_modules = {k[0] for k in now.keys() - before.keys()} - {k[0] for k in before}
    return {k for k in before if k not in now or now[k] is not before[k]} | {
        k for k in added if k[0] not in new_modules
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def main(prefix: str) -> None:
    before = _workload()
    attributes = _torch_attributes()
    ops = set(torch._C._dispatch_get_all_op_names())  # every operator the dispatcher knows
    rng = torch.get_rng_state()

    import remat

    assert remat.__file__.startswith(prefix), f"imported {remat.__file__}, not from {prefix}"
    assert remat.__version__ == importlib.metadata.version("remat")
    new_ops = set(torch._C._dispatch_get_all_op_names()) - ops
    assert new_ops == {"remat::unpack", "remat::unpack_kept"}, sorted(new_ops)
    changed = _changed(attributes, _torch_attributes())
    assert changed == REPLACED, sorted(changed)
    assert torch.equal(torch.get_rng_state(), rng), "importing remat drew random numbers"
    assert torch._C._len_torch_dispatch_stack() == 0, "a dispatch mode is active"
    assert torch._C._len_torch_function_stack() == 0, "a torch-function mode is active"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "hooks pushed"
    assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == 0
    assert torch.is_grad_enabled()
    assert not torch._C._is_any_autocast_enabled()

    after = _workload()
    assert before.keys() == after.keys()
    differ = [k for k in before if not _same(before[k], after[k])]
    assert not differ, f"results changed by `import remat`: {differ}"
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])

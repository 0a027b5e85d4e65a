"""Module state a region reaches however ``fn`` holds it, trained bitwise as plain autograd.

Each model trains 3 SGD steps, once plain and once with a remat region, from the same
weights on the same batches; every step's output and gradients, and the final parameters and
buffers, are compared bitwise. The regions reach their modules through containers (as
torch's ``checkpoint_sequential`` and timm's ``checkpoint_seq`` pass them), defaults,
globals, partials and objects, under every policy, in eager mode and under
``functional_call`` with ``torch.func.grad``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.func import functional_call

import remat
from tests.helpers import DTYPE, POLICIES, assert_tree_equal

each_policy = pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).to(DTYPE)


def _batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=generator, dtype=DTYPE)


def _run_all(functions: Any, x: torch.Tensor) -> torch.Tensor:
    for f in functions:
        x = f(x)
    return x


GLOBAL_NET: nn.Module | None = None


class _Holder:
    """Not a module: an object holding the layers, whose method the region runs."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return _run_all(self.layers, x)

    __call__ = run


def _segment(reach: str, net: nn.Sequential) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of ``x`` that runs ``net``'s layers, holding them as ``reach`` says."""
    layers = list(net)
    if reach == "list":

        def seg(x: torch.Tensor) -> torch.Tensor:
            return _run_all(layers, x)

    elif reach == "dict":
        named = {str(i): layer for i, layer in enumerate(layers)}

        def seg(x: torch.Tensor) -> torch.Tensor:
            return _run_all([named[k] for k in sorted(named)], x)

    elif reach == "nested":
        box = [(layers[:2],), {"rest": layers[2:]}]

        def seg(x: torch.Tensor) -> torch.Tensor:
            return _run_all(box[0][0] + box[1]["rest"], x)  # type: ignore[index,operator]

    elif reach == "default":

        def seg(x: torch.Tensor, layers: tuple[nn.Module, ...] = tuple(layers)) -> torch.Tensor:
            return _run_all(layers, x)

    elif reach == "keyword_default":

        def seg(x: torch.Tensor, *, layers: list[nn.Module] = layers) -> torch.Tensor:
            return _run_all(layers, x)

    elif reach == "global":
        global GLOBAL_NET
        GLOBAL_NET = net

        def seg(x: torch.Tensor) -> torch.Tensor:
            assert GLOBAL_NET is not None
            return GLOBAL_NET(x)

    elif reach == "partial":
        seg = functools.partial(_run_all, layers)  # type: ignore[assignment]
    elif reach == "bound_method_of_object":
        seg = _Holder(layers).run  # type: ignore[assignment]
    elif reach == "callable_object":
        seg = _Holder(layers)  # type: ignore[assignment]
    elif reach == "module_list":
        modules = nn.ModuleList(layers)

        def seg(x: torch.Tensor) -> torch.Tensor:
            return _run_all(modules, x)

    else:
        raise ValueError(reach)
    return seg


REACHES = (
    "list",
    "dict",
    "nested",
    "default",
    "keyword_default",
    "global",
    "partial",
    "bound_method_of_object",
    "callable_object",
    "module_list",
)


def _train_eager(net: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """3 SGD steps: each step's output and gradients, then every parameter and buffer."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    history = []
    for step in range(3):
        opt.zero_grad()
        out = forward(_batch(step))
        out.sin().sum().backward()
        history.append((out, {n: p.grad.clone() for n, p in net.named_parameters()}))
        opt.step()
    return history, {k: v.clone() for k, v in net.state_dict().items()}


def _train_func(net: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same 3 steps, as ``torch.func.grad`` of ``functional_call`` over the parameters
    (the buffers are arguments too, which batch norm updates in place)."""
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    history = []
    for step in range(3):

        def loss(p: dict[str, Any], b: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
            return functional_call(net, {**p, **b}, (x,)).sin().sum()

        grads = torch.func.grad(loss)(params, buffers, _batch(step))
        history.append(grads)
        params = {n: params[n] - 0.1 * grads[n] for n in params}
    return history, params, buffers


class _Region(nn.Module):
    """``net`` run through a segment function, wrapped by ``wrap`` (identity, or remat)."""

    def __init__(self, net: nn.Sequential, reach: str, wrap: Callable[..., Any]) -> None:
        super().__init__()
        self.net = net
        self.segment = _segment(reach, net)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrap(self.segment)(x)


TRAININGS = {"eager": _train_eager, "functional_call_grad": _train_func}


@pytest.mark.parametrize("train", TRAININGS.values(), ids=TRAININGS.keys())
@pytest.mark.parametrize("reach", REACHES)
@each_policy
def test_modules_reached_through_containers_train_as_plain(policy, reach, train):
    """Modules in lists, dicts, defaults, globals, partials, objects: plain's training, bitwise."""
    plain = _Region(_net(), reach, lambda f: f)
    expected = train(plain, plain)  # before `kept` exists: "global" rebinds a global
    kept = _Region(_net(), reach, functools.partial(remat.remat, policy=policy))
    assert_tree_equal(train(kept, kept), expected)


def test_checkpoint_sequential_with_remat_checkpoint(monkeypatch):
    """torch's checkpoint_sequential, with remat.checkpoint as its checkpoint: plain's training."""
    plain, kept = _net(), _net()
    expected = _train_eager(plain, plain)
    monkeypatch.setattr(torch_checkpoint, "checkpoint", remat.checkpoint)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint_sequential(kept, 2, x, use_reentrant=False)

    assert_tree_equal(_train_eager(kept, forward), expected)


def _checkpoint_seq(functions: nn.Sequential, x: torch.Tensor, every: int) -> torch.Tensor:
    """timm's ``checkpoint_seq``: a closure over the list of blocks runs each segment."""

    def run_function(start: int, end: int, functions: list[nn.Module]) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            for j in range(start, end + 1):
                x = functions[j](x)
            return x

        return forward

    blocks = list(functions.children())
    for start in range(0, len(blocks), every):
        end = min(start + every, len(blocks)) - 1
        x = remat.checkpoint(run_function(start, end, blocks), x)
    return x


def test_timm_style_checkpoint_seq():
    """A timm-style checkpoint_seq closure over a list of blocks: plain's training, bitwise."""
    plain, kept = _net(), _net()
    expected = _train_eager(plain, plain)
    assert_tree_equal(_train_eager(kept, lambda x: _checkpoint_seq(kept, x, 2)), expected)

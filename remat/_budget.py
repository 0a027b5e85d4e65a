"""`memory_budget`'s choice: which values a region keeps, made once per region signature.

The first forward of a signature keeps every op output tentatively. When it ends,
the candidates are the outputs the backward reads (a view's base stands for the
view); plain autograd's bytes for the region are what it saved. The candidates are
ranked once, greedily, by the recompute cost keeping each one spares per byte it
holds, given the ones ranked before it. The budget grows what it keeps in steps of 1%
of plain's bytes, each step adding, in rank order, the candidates that fit. So a larger
budget keeps a superset, and since every candidate is read by the backward, it holds
more bytes and the recompute (what the backward needs, stopping at kept values) runs a
subset of the ops.

Later forwards of the signature replay the choice by op index, after checking that
the ops, their output layouts, what each read and what autograd saved are the planned
ones; if they are not, that forward keeps nothing and the next one chooses again.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import _torch_private
from ._policies import OpCall

__all__ = ["Plan", "choose", "estimated_cost", "lookup", "signature", "store"]

# Machine balance: FLOPs a device computes in the time it moves one byte. Measured on
# the 2-core CI machine (mm at ~120 GFLOP/s, gelu and softmax at 8-16 GB/s) for CPU;
# for CUDA, an H100's TF32 tensor rate over its memory bandwidth (~400 TFLOP/s over
# ~3.4 TB/s). Only ratios of costs matter to the choice.
_BALANCE = {"cpu": 10.0, "cuda": 100.0}
_DEFAULT_BALANCE = 10.0


def estimated_cost(call: OpCall) -> float:
    """A roofline estimate of an op's time, in FLOPs: ``max(flops, balance * bytes)``.

    FLOPs come from torch's FLOP counter formulas (matrix products, convolutions,
    attention), bytes moved are those of the tensor arguments and outputs.
    """
    tree: Any = (call.args, call.kwargs, call.output)
    leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=True)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    moved = sum(t.nbytes for t in tensors if t.layout == torch.strided)
    device = tensors[0].device.type if tensors else "cpu"
    flops = _torch_private.flops(call.op, call.args, call.kwargs, call.output)
    return max(float(flops), _BALANCE.get(device, _DEFAULT_BALANCE) * moved)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a budget keeps in one region signature, and the forward it was made for.

    The forward is its ops, their output layouts, the ops each read, and the ops whose
    outputs autograd saved. ``keep`` holds op indices; ``why`` says what each spares;
    ``plain`` is what plain autograd holds for the region, ``held`` what the plan does.
    """

    ops: tuple[Any, ...]
    layouts: tuple[Any, ...]
    deps: tuple[tuple[int, ...], ...]
    wanted: frozenset[int]
    keep: frozenset[int]
    why: dict[int, str]
    plain: int
    held: int

    def fits(self, index: int, op: Any, layout: Any, deps: tuple[int, ...]) -> bool:
        """Whether op ``index`` of a forward is the one planned."""
        return (
            index < len(self.ops)
            and self.ops[index] is op
            and self.layouts[index] == layout
            and self.deps[index] == deps
        )


# A budget grows what it keeps in steps of 1% of plain autograd's bytes, each step adding
# the candidates that fit, in rank order: what a larger budget keeps contains the rest.
_STEPS = 100


def choose(
    fraction: float,
    candidates: dict[int, int],
    plain: int,
    deps: list[tuple[int, ...]],
    costs: list[float],
    starts: list[int],
) -> tuple[list[int], dict[int, str]]:
    """The candidates a budget keeps, and why each.

    Args:
        fraction: the budget, a share of ``plain``.
        candidates: op index -> bytes its outputs hold.
        plain: bytes plain autograd holds for the region.
        deps: op index -> the ops it read.
        costs: op index -> estimated cost of running it again.
        starts: the ops the backward needs (values it reads, ops that always run).
    """
    ranked = _ranking(candidates, deps, costs, starts)
    kept: dict[int, float] = {}
    held = 0
    for step in range(1, int(fraction * _STEPS + 1e-9) + 1):
        limit = step * plain / _STEPS
        for c, gain in ranked:
            if c not in kept and held + candidates[c] <= limit:
                kept[c] = gain
                held += candidates[c]
    return list(kept), {c: f"spares recompute cost {gain:.3g}" for c, gain in kept.items()}


def _ranking(
    candidates: dict[int, int], deps: list[tuple[int, ...]], costs: list[float], starts: list[int]
) -> list[tuple[int, float]]:
    """The candidates, greedily by the recompute cost each spares per byte it holds,
    given those ranked before it; with what each spares. Gains are re-evaluated lazily."""
    kept: set[int] = set()
    base = _recompute_cost(starts, deps, costs, kept)
    heap = [
        (-_gain(c, base, starts, deps, costs, kept) / max(size, 1), c)
        for c, size in candidates.items()
    ]
    heapq.heapify(heap)
    ranked: list[tuple[int, float]] = []
    while heap:
        _, c = heapq.heappop(heap)
        gain = _gain(c, base, starts, deps, costs, kept)
        density = gain / max(candidates[c], 1)
        if heap and density < -heap[0][0]:  # worth less now: rank it again among the rest
            heapq.heappush(heap, (-density, c))
            continue
        ranked.append((c, gain))
        kept.add(c)
        base -= gain
    return ranked


def _gain(
    c: int,
    base: float,
    starts: list[int],
    deps: list[tuple[int, ...]],
    costs: list[float],
    kept: set[int],
) -> float:
    kept.add(c)
    try:
        return base - _recompute_cost(starts, deps, costs, kept)
    finally:
        kept.discard(c)


def _recompute_cost(
    starts: list[int], deps: list[tuple[int, ...]], costs: list[float], kept: set[int]
) -> float:
    """Cost of the ops a recompute runs: what ``starts`` needs, stopping at kept ops."""
    seen: set[int] = set()
    stack = list(starts)
    total = 0.0
    while stack:
        index = stack.pop()
        if index in seen:
            continue
        seen.add(index)
        if index in kept:
            continue
        total += costs[index]
        stack.extend(deps[index])
    return total


def signature(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> tuple[Any, ...]:
    """A region's signature for its plan: ``fn``'s code and its inputs' layouts."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None) or type(fn)
    return code, tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in inputs)


# (policy, signature) -> plan, least recently stored first; bounded, as code objects
# of functions made per call (lambdas in a loop) would pile up.
_PLANS: OrderedDict[Any, Plan] = OrderedDict()
_MAX_PLANS = 512


def lookup(policy: Any, key: Any) -> Plan | None:
    return _PLANS.get((policy, key))


def store(policy: Any, key: Any, plan: Plan | None) -> None:
    """Remember ``plan`` for ``key`` (or forget the key's plan, for None)."""
    _PLANS.pop((policy, key), None)
    if plan is not None:
        _PLANS[(policy, key)] = plan
        while len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)

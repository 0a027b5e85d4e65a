"""`memory_budget`'s choice: which values a region keeps, made once per region signature.

The first forward of a signature keeps every op output tentatively. When it ends,
the candidates are the outputs the backward reads (a view's base stands for the
view); plain autograd's bytes for the region are what it saved. The choices for
budgets of 0%, 1%, ..., 100% of plain's bytes are made together, from the top down:
each step keeps a subset of what the step above keeps, dropping first what spares the
least recompute cost per byte. So a larger budget keeps a superset, and since every
candidate is read by the backward, it holds more bytes and the recompute (what the
backward needs, stopping at kept values) runs a subset of the ops.

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


# A budget's choices form a chain over steps of 1% of plain autograd's bytes: the set kept
# at one step contains the set kept at the step below, so a larger budget keeps more.
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
    step = int(fraction * _STEPS + 1e-9)
    chain = _chain(candidates, plain, functools.partial(_recompute_cost, starts, deps, costs))
    kept = {c: why for c, (first, why) in chain.items() if 0 < first <= step}
    return list(kept), kept


def _chain(
    candidates: dict[int, int], plain: int, cost: Callable[[set[int]], float]
) -> dict[int, tuple[int, str]]:
    """Candidate -> the first step that keeps it, and what keeping it spares there.

    From the top down: each step starts from the set kept one step up and drops, while it
    holds more than the step allows, the candidate whose loss adds the least recompute
    cost per byte it frees; then takes back, dearest per byte first, those it dropped
    that fit again. Losses change as others go: one is evaluated again when it comes
    first, and put back if it no longer does.
    """
    kept = set(candidates)
    held = sum(candidates.values())
    base = cost(kept)

    def loss(c: int) -> float:
        return cost(kept - {c}) - base

    def per_byte(c: int, value: float) -> float:
        return value / max(candidates[c], 1)

    heap = [(per_byte(c, loss(c)), c) for c in candidates]
    heapq.heapify(heap)
    first: dict[int, tuple[int, str]] = {}
    for step in range(_STEPS, -1, -1):
        limit = step * plain / _STEPS
        dropped = []
        while held > limit:
            _, c = heapq.heappop(heap)
            lost = loss(c)
            if heap and per_byte(c, lost) > heap[0][0]:
                heapq.heappush(heap, (per_byte(c, lost), c))
                continue
            kept.discard(c)
            held -= candidates[c]
            base += lost
            dropped.append((c, lost))
        for c, _ in sorted(dropped, key=lambda d: -per_byte(*d)):
            gain = base - cost(kept | {c})
            if held + candidates[c] <= limit and gain > 0:
                kept.add(c)
                held += candidates[c]
                base -= gain
                heapq.heappush(heap, (per_byte(c, gain), c))
            else:
                first[c] = (step + 1, f"spares recompute cost {gain:.3g}")
    return first


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

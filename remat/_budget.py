"""`memory_budget`'s choice: which values a region keeps, made once per program.

The first forward of a program keeps every op output tentatively. When it ends, the
candidates are the outputs the backward reads (a view's base stands for the view, the
last step of an in-place chain for the chain); plain autograd's bytes for the region are
what it saved. Both leave out the region's outputs, which the caller holds. The choices
for budgets of 0%, 1%, ..., 100% of plain's bytes are made together, as one chain of
sets: each step keeps a superset of what the step below keeps. So a larger budget holds
more bytes, and since every candidate is read by the backward, the recompute (what the
backward needs, stopping at kept values) runs a subset of the ops. Three greedy rankings
propose sets for each step (`_greedy`, twice, and `_growing`); of the chains through
them, the one whose worst step is nearest the cheapest proposal for that step, then the
cheapest in sum, is kept (`_nested`).

Later forwards of the program follow it (`Keeper.follow`): each op's signature is
checked against the planned forward's, and what autograd saved against what it saved; a
forward that leaves the program keeps nothing from there, and the next one chooses
again.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import _torch_private
from ._policies import OpCall
from ._rng import is_random

__all__ = ["Plan", "choose", "estimated_cost"]

# Machine balance: FLOPs a device computes in the time it moves one byte. Measured on
# the 2-core CI machine (mm at ~120 GFLOP/s, gelu and softmax at 8-16 GB/s) for CPU;
# for CUDA, an H100's TF32 tensor rate over its memory bandwidth (~400 TFLOP/s over
# ~3.4 TB/s). Only ratios of costs matter to the choice.
_BALANCE = {"cpu": 10.0, "cuda": 100.0}
_DEFAULT_BALANCE = 10.0
# Random ops draw each number: on that machine's CPU, bernoulli_ writes 0.46 GB/s and
# uniform_ and normal_ 0.8 GB/s, where gelu moves 7.6 GB/s. Elsewhere (CUDA's Philox
# kernels are memory-bound) they count as other elementwise ops: not measured there.
_RANDOM_SLOWDOWN = {"cpu": 16.0}


def estimated_cost(call: OpCall) -> float:
    """A roofline estimate of an op's time, in FLOPs: ``max(flops, balance * bytes)``.

    FLOPs come from torch's FLOP counter formulas (matrix products, convolutions,
    attention), bytes moved are those of the tensor arguments and outputs; a random op's
    bytes count as many times as drawing is slower than moving them.
    """
    tree: Any = (call.args, call.kwargs, call.output)
    leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=True)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    moved = float(sum(t.nbytes for t in tensors if t.layout == torch.strided))
    device = tensors[0].device.type if tensors else "cpu"
    flops = _torch_private.flops(call.op, call.args, call.kwargs, call.output)
    if is_random(call.op):
        moved *= _RANDOM_SLOWDOWN.get(device, 1.0)
    return max(float(flops), _BALANCE.get(device, _DEFAULT_BALANCE) * moved)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a budget keeps in one region's program (`_keep.Program`), which holds the ops.

    ``ops`` counts the forward's ops, ``wanted`` the ops whose outputs autograd saved;
    ``keep`` holds op indices; ``why`` says what each spares; ``plain`` is what plain
    autograd holds for the region, ``held`` what the plan does.
    """

    ops: int
    wanted: frozenset[int]
    keep: frozenset[int]
    why: dict[int, str]
    plain: int
    held: int


# A budget's choices are made over steps of 1% of plain autograd's bytes.
_STEPS = 100


def choose(
    fraction: float,
    candidates: dict[int, int],
    plain: int,
    deps: list[tuple[int, ...]],
    costs: list[float],
    starts: list[int],
    chains: dict[int, tuple[int, ...]],
) -> tuple[list[int], dict[int, str]]:
    """The candidates a budget keeps, and why each.

    Args:
        fraction: the budget, a share of ``plain``.
        candidates: op index -> bytes its outputs hold.
        plain: bytes plain autograd holds for the region.
        deps: op index -> the ops it read.
        costs: op index -> estimated cost of running it again.
        starts: the ops the backward needs (values it reads, ops that always run).
        chains: a candidate that ends an in-place chain -> the chain's ops, which the
            recompute does not run when the candidate is kept.
    """
    cost = functools.cache(functools.partial(_recompute_cost, starts, deps, costs, chains))
    pool = {kept for need in (False, True) for kept in _greedy(candidates, plain, cost, need)}
    pool.update(_growing(candidates, plain, cost))
    kept = _nested(sorted(pool, key=sorted), candidates, plain, cost)[int(fraction * _STEPS + 1e-9)]
    base = cost(kept)
    return sorted(kept), {c: f"spares recompute cost {cost(kept - {c}) - base:.3g}" for c in kept}


def _greedy(
    candidates: dict[int, int],
    plain: int,
    cost: Callable[[frozenset[int]], float],
    need: bool,
) -> list[frozenset[int]]:
    """Step -> the set a greedy ranking keeps there, from the top down.

    Each step starts from the set kept one step up and drops, while it holds more than the
    step allows, the candidate whose loss adds the least recompute cost per byte it frees
    (with ``need``, counting no more bytes than are still to free, so that one value that
    frees enough is not passed over for a larger one); then takes back, dearest per byte
    first, those it dropped that fit again.
    """
    kept = frozenset(candidates)
    held = sum(candidates.values())
    base = cost(kept)

    def per_byte(c: int, value: float) -> float:
        return value / max(candidates[c], 1)

    def loss(c: int) -> tuple[float, float, float]:
        lost = cost(kept - {c}) - base
        freed = min(candidates[c], held - step * plain // _STEPS) if need else candidates[c]
        return lost / max(freed, 1), per_byte(c, lost), lost

    heap = [(per_byte(c, cost(kept - {c}) - base), c) for c in candidates]
    heapq.heapify(heap)
    sets = []
    for step in range(_STEPS, -1, -1):
        dropped = []
        while held * _STEPS > step * plain:
            best = _pop_best(heap, loss)
            assert best is not None  # what is held is in the heap
            c, lost = best
            kept -= {c}
            held -= candidates[c]
            base += lost
            dropped.append((c, lost))
        for c, _ in sorted(dropped, key=lambda d: -per_byte(*d)):
            gain = base - cost(kept | {c})
            if (held + candidates[c]) * _STEPS <= step * plain and gain > 0:
                kept |= {c}
                held += candidates[c]
                base -= gain
                heapq.heappush(heap, (per_byte(c, gain), c))
        sets.append(kept)
    return sets[::-1]


def _growing(
    candidates: dict[int, int], plain: int, cost: Callable[[frozenset[int]], float]
) -> list[frozenset[int]]:
    """Step -> the set a greedy ranking keeps there, from the bottom up: each step starts
    from the set kept one step down and adds, while one fits and spares any recompute cost,
    the candidate that spares the most per byte (found lazily, `_pop_best`)."""
    kept: frozenset[int] = frozenset()
    held = 0
    base = cost(kept)

    def spares(c: int) -> tuple[float, float, float] | None:
        if (held + candidates[c]) * _STEPS > limit:
            return None  # too large for this step
        spared = base - cost(kept | {c})
        key = -spared / max(candidates[c], 1)
        return key, key, spared

    heap = [(-(base - cost(frozenset({c}))) / max(n, 1), c) for c, n in candidates.items()]
    heapq.heapify(heap)
    sets = []
    for step in range(_STEPS + 1):
        limit = step * plain  # in bytes times _STEPS
        waiting: list[tuple[float, int]] = []  # too large for this step
        while True:
            best = _pop_best(heap, spares, waiting)
            if best is None:
                break
            c, gain = best
            if gain <= 0:  # nothing that fits spares anything now
                waiting.append((-gain / max(candidates[c], 1), c))
                break
            kept |= {c}
            held += candidates[c]
            base -= gain
        heap.extend(waiting)
        heapq.heapify(heap)
        sets.append(kept)
    return sets


def _pop_best(
    heap: list[tuple[float, int]],
    fresh: Callable[[int], tuple[float, float, float] | None],
    aside: list[tuple[float, int]] | None = None,
) -> tuple[int, float] | None:
    """Pop the candidate of ``heap`` whose rank is least now, and its value.

    The heap holds keys as last evaluated; values change as others are kept or dropped.
    ``fresh(c)`` gives ``c``'s rank, key and value now, or None to set ``c`` into ``aside``.
    Candidates are evaluated in key order until the next key exceeds the best rank found
    (a rank is no less than the key while values do not shrink); the others go back
    with fresh keys.
    """
    best: tuple[float, int, float] | None = None
    seen = []
    while heap and (best is None or heap[0][0] < best[0]):
        stored, c = heapq.heappop(heap)
        found = fresh(c)
        if found is None:
            assert aside is not None
            aside.append((stored, c))
            continue
        rank, key, value = found
        seen.append((key, c))
        if best is None or (rank, c) < best[:2]:
            best = (rank, c, value)
    if best is None:
        return None
    for key, c in seen:
        if c != best[1]:
            heapq.heappush(heap, (key, c))
    return best[1], best[2]


def _nested(
    pool: list[frozenset[int]],
    candidates: dict[int, int],
    plain: int,
    cost: Callable[[frozenset[int]], float],
) -> list[frozenset[int]]:
    """Step -> the set kept there: a chain of sets from ``pool``, each within its step's
    bytes and containing the step below's.

    Of those chains, the ones whose worst step costs least against the cheapest set in
    ``pool`` that fits that step; of these, the one whose cost summed over the steps is
    least. A chain moves to its next set at the first step that set fits (a superset
    recomputes no more), so each is found by dynamic programming over ``pool`` in order of
    that step; ties go to the first in ``pool``.
    """
    first = {s: -(-sum(candidates[c] for c in s) * _STEPS // max(plain, 1)) for s in pool}
    order = [s for s in pool if first[s] <= _STEPS]
    order.sort(key=lambda s: first[s])
    least = [math.inf] * (_STEPS + 1)
    for s in order:
        for step in range(first[s], _STEPS + 1):
            least[step] = min(least[step], cost(s))

    def regret(s: frozenset[int], end: int) -> float:
        """The worst of ``cost(s)`` against the cheapest, from its first step to ``end``."""
        if end == first[s]:
            return 0.0
        return cost(s) / least[end - 1] if least[end - 1] else 1.0 + cost(s)

    bound = _chain(order, first, lambda s, end, below: max(below, regret(s, end)))[0]

    def total(s: frozenset[int], end: int, below: float) -> float:
        ok = regret(s, end) <= bound
        return below + cost(s) * (end - first[s]) if ok else math.inf

    return _chain(order, first, total)[1]


def _chain(
    order: list[frozenset[int]],
    first: dict[frozenset[int], int],
    score: Callable[[frozenset[int], int, float], float],
) -> tuple[float, list[frozenset[int]]]:
    """The chain of sets from ``order`` that minimizes a score, ``score(s, end, below)``
    for set ``s`` kept up to step ``end`` after a chain scoring ``below``; and the chain,
    as each step's set."""
    best: dict[frozenset[int], tuple[float, frozenset[int] | None]] = {}
    for s in order:
        below: list[tuple[float, frozenset[int] | None]]
        below = [(score(t, first[s], b), t) for t, (b, _) in best.items() if t <= s]
        if first[s] == 0:
            below.append((0.0, None))
        if below:
            best[s] = min(below, key=lambda b: b[0])
    least, last = min(
        ((score(s, _STEPS + 1, b), s) for s, (b, _) in best.items()), key=lambda b: b[0]
    )
    sets: list[frozenset[int]] = []
    end = _STEPS + 1
    node: frozenset[int] | None = last
    while node is not None:
        sets[:0] = [node] * (end - first[node])
        end = first[node]
        node = best[node][1]
    return least, sets


def _recompute_cost(
    starts: list[int],
    deps: list[tuple[int, ...]],
    costs: list[float],
    chains: dict[int, tuple[int, ...]],
    kept: set[int],
) -> float:
    """Cost of the ops a recompute runs: what ``starts`` needs, stopping at kept ops
    (and at the ops of kept chains)."""
    seen: set[int] = {member for end in kept & chains.keys() for member in chains[end]}
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

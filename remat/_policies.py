"""Policies: what a remat region keeps for backward, and what it recomputes.

A policy is data: a frozen dataclass with ``__call__(OpCall) -> Decision | bool``.
The engine asks it about the outputs of every aten op of a region's forward
(random, in-place and view ops excepted: they are always recomputed).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch

from . import _torch_private

__all__ = [
    "Decision",
    "OpCall",
    "Policy",
    "memory_budget",
    "offload",
    "resolve",
    "save_all_but_names",
    "save_everything",
    "save_matmuls",
    "save_matmuls_no_batch",
    "save_names",
    "save_nothing",
    "save_ops",
]

aten = torch.ops.aten


class Decision(enum.IntEnum):
    """What a policy decides for the output of one op (ordered: keep strength)."""

    RECOMPUTE = 0
    OFFLOAD = 1
    SAVE = 2


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One aten op call inside a remat region, as a policy sees it.

    Attributes:
        op: the aten ``OpOverload`` that ran.
        args: its positional arguments (empty when asked again by `remat.name`).
        kwargs: its keyword arguments.
        output: what it returned.
        names: the tags given to its output with `remat.name`.
    """

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    names: frozenset[str] = frozenset()


def as_decision(policy: Any, result: Any, op: Any) -> Decision:
    if isinstance(result, Decision):
        return result
    if isinstance(result, bool):
        return Decision.SAVE if result else Decision.RECOMPUTE
    raise TypeError(
        f"`remat`: a policy must return a bool or a `remat.policies.Decision`, but "
        f"{policy!r} returned {result!r} for {op}."
    )


def _matches(op: Any, ops: frozenset[Any]) -> bool:
    """Whether ``op`` (an ``OpOverload``) is in ``ops``, as itself or as its packet."""
    return op in ops or getattr(op, "overloadpacket", None) in ops


class Policy:
    """Base of policy objects. Combine them with ``|`` (either keeps) and ``&`` (both keep).

    ``keeps_everything`` marks a policy under which a region is just ``fn``;
    ``per_op`` says whether the engine must show the policy each op;
    ``by_op`` says whether the decision depends on the op alone (the engine then asks
    once per op and region); ``device`` is where `offload` moves what it keeps;
    ``budget`` is the `memory_budget` that chooses among what the policy keeps.
    """

    keeps_everything: bool = False
    per_op: bool = True
    by_op: bool = False
    device: torch.device | None = None
    budget: memory_budget | None = None

    def __call__(self, call: OpCall) -> Decision | bool:
        raise NotImplementedError

    def decide(self, op: Any, call: Callable[[], OpCall]) -> Decision:
        """The decision for one op; ``call`` builds the `OpCall` only if needed."""
        return as_decision(self, self(call()), op)

    def __or__(self, other: Policy) -> Policy:
        return _Combined(self, resolve(other), "|")

    def __and__(self, other: Policy) -> Policy:
        return _Combined(self, resolve(other), "&")


@dataclasses.dataclass(frozen=True, repr=False)
class _Named(Policy):
    """A policy given by name; ``ops`` (when set) is its whole logic."""

    name: str
    ops: frozenset[Any] = frozenset()
    keep: Decision = Decision.RECOMPUTE
    by_op = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_op", bool(self.ops))
        object.__setattr__(self, "keeps_everything", self.keep is Decision.SAVE)

    def __call__(self, call: OpCall) -> Decision:
        return self.decide(call.op, lambda: call)

    def decide(self, op: Any, call: Callable[[], OpCall]) -> Decision:
        return Decision.SAVE if _matches(op, self.ops) else self.keep

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[Any, ...]:
        return resolve, (self.name,)


_NO_BATCH = frozenset({aten.mm, aten.addmm, aten.mv, aten.addmv, aten.dot, aten.vdot})
_BATCHED = frozenset(
    {
        aten.bmm,
        aten.baddbmm,
        aten._scaled_mm,
        aten.convolution,
        aten._convolution,
        aten.cudnn_convolution,
        aten.mkldnn_convolution,
        aten.convolution_overrideable,
    }
)

save_nothing: Policy = _Named("save_nothing")
"""Keep only the region's inputs; recompute every intermediate (the default)."""

save_everything: Policy = _Named("save_everything", keep=Decision.SAVE)
"""Keep what plain autograd keeps: the region costs what ``fn`` costs."""

save_matmuls: Policy = _Named("save_matmuls", _NO_BATCH | _BATCHED)
"""Keep the outputs of matrix products and convolutions; replay them in the recompute.

Covers ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``addmv``, ``dot``,
``_scaled_mm`` and ``convolution``: ``matmul``, ``linear``, ``einsum`` and
``conv*d`` run as these ops.
"""

save_matmuls_no_batch: Policy = _Named("save_matmuls_no_batch", _NO_BATCH)
"""Like `save_matmuls`, for products without batch dimensions only.

``linear`` on inputs of any rank runs as ``mm``/``addmm`` and is kept; batched
products (``bmm``, ``baddbmm``: attention scores) are recomputed.
"""


@dataclasses.dataclass(frozen=True)
class save_ops(Policy):  # noqa: N801 - a policy factory, named like its siblings
    """Keep the outputs of the given aten ops (``OpOverload`` or ``OpOverloadPacket``).

    Examples:
        >>> import torch
        >>> from remat import remat, policies
        >>> f = remat(lambda x: x.sin().exp(), policy=policies.save_ops(torch.ops.aten.sin))
    """

    ops: frozenset[Any]
    by_op = True

    def __init__(self, *ops: Any) -> None:
        for op in ops:
            if not _torch_private.is_aten_op(op):
                raise TypeError(
                    f"`save_ops` takes aten ops such as `torch.ops.aten.mm`, got {op!r}."
                )
        object.__setattr__(self, "ops", frozenset(ops))

    def __call__(self, call: OpCall) -> Decision:
        return self.decide(call.op, lambda: call)

    def decide(self, op: Any, call: Callable[[], OpCall]) -> Decision:
        return Decision.SAVE if _matches(op, self.ops) else Decision.RECOMPUTE

    def __reduce__(self) -> tuple[Any, ...]:
        # aten operators do not pickle; their names do (a pickled model keeps its policy).
        return _save_ops_named, tuple(sorted(str(op) for op in self.ops))


def _save_ops_named(*names: str) -> save_ops:
    """`save_ops` of the operators named like ``aten.mm`` or ``aten.mm.default``."""
    ops = []
    for name in names:
        op: Any = torch.ops
        for part in name.split("."):
            op = getattr(op, part)
        ops.append(op)
    return save_ops(*ops)


def _check_names(factory: str, names: tuple[str, ...]) -> frozenset[str]:
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"`{factory}` takes names (str), got {name!r}.")
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class save_names(Policy):  # noqa: N801
    """Keep only the tensors tagged with one of ``names`` by `remat.name`."""

    names: frozenset[str]

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", _check_names("save_names", names))

    def __call__(self, call: OpCall) -> bool:
        return bool(call.names & self.names)


@dataclasses.dataclass(frozen=True)
class save_all_but_names(Policy):  # noqa: N801
    """Keep every op output except tensors tagged with one of ``names``.

    Unlike JAX's ``save_anything_except_these_names``, this is not a no-op: the
    named tensors are recomputed, and of the rest only what a backward reads
    (directly, or to recompute the named ones) is held.
    """

    names: frozenset[str]

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", _check_names("save_all_but_names", names))

    def __call__(self, call: OpCall) -> bool:
        return not call.names & self.names


@dataclasses.dataclass(frozen=True)
class offload(Policy):  # noqa: N801
    """Move what ``policy`` keeps to ``device`` (pinned memory from CUDA), and back on use.

    The copy to ``device`` is issued at the end of the region's forward; on the
    way back, values are copied to their device when the recompute or a
    backward formula reads them.
    """

    policy: Policy
    device: torch.device

    def __init__(self, policy: Any, device: str | torch.device = "cpu") -> None:
        object.__setattr__(self, "policy", resolve(policy))
        object.__setattr__(self, "device", _device(device))
        object.__setattr__(self, "by_op", self.policy.by_op)
        object.__setattr__(self, "budget", self.policy.budget)

    def decide(self, op: Any, call: Callable[[], OpCall]) -> Decision:
        decision = self.policy.decide(op, call)
        return Decision.OFFLOAD if decision is Decision.SAVE else decision

    def __call__(self, call: OpCall) -> Decision:
        return self.decide(call.op, lambda: call)


def _device(device: Any) -> torch.device:
    """`offload`'s ``device``, checked now rather than in the first forward."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"`offload`: `device` must be a torch device such as 'cpu', got {device!r}."
        ) from None
    module = getattr(torch, target.type, None)
    available = getattr(module, "is_available", None)
    if target.type != "cpu" and (available is None or not available()):
        raise ValueError(
            f"`offload`: `device` is {device!r}, but this machine has no {target.type} "
            "device. Offload to 'cpu' (the usual target), or to a device torch can use here."
        )
    return target


@dataclasses.dataclass(frozen=True)
class memory_budget(Policy):  # noqa: N801
    """Keep at most ``fraction`` of what plain autograd keeps; recompute the cheapest rest.

    Per region, the kept values are at most ``fraction`` times the bytes plain autograd
    holds for the region (its inputs, held by reference, are not counted). Among the
    values the backward reads, the budget keeps those whose recompute costs most per
    byte (``cost`` estimates an op's cost; by default a roofline: FLOPs for matrix
    products and convolutions, bytes moved for the rest). The region's outputs are the
    caller's: neither counted nor kept. The choice is made on the first call of each
    region program (module or function, training mode, input shapes, dtypes and
    devices), which holds every value its backward reads until the region ends, and
    followed after. A larger ``fraction`` never holds less nor recomputes more. ``0`` is
    `save_nothing`, ``1`` is `save_everything`.

    Examples:
        >>> import torch
        >>> from remat import remat, policies
        >>> f = remat(lambda x: x.sin().exp(), policy=policies.memory_budget(0.5))
        >>> torch.func.grad(lambda x: f(x).sum())(torch.ones(3))
        tensor([1.2534, 1.2534, 1.2534])
    """

    fraction: float
    cost: Callable[[OpCall], float] | None = None
    by_op = True

    def __init__(self, fraction: float, *, cost: Callable[[OpCall], float] | None = None) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(
                f"`memory_budget`: `fraction` must be a number in [0, 1], got {fraction!r}."
            )
        if not 0 <= fraction <= 1:
            raise ValueError(
                f"`memory_budget`: `fraction` must be in [0, 1] (a share of what plain "
                f"autograd keeps), got {fraction!r}."
            )
        if cost is not None and not callable(cost):
            raise TypeError(
                f"`memory_budget`: `cost` must be a callable taking an `OpCall` and "
                f"returning a number, got {cost!r}."
            )
        object.__setattr__(self, "fraction", float(fraction))
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "per_op", fraction > 0)
        object.__setattr__(self, "keeps_everything", fraction == 1)
        object.__setattr__(self, "budget", self)

    def decide(self, op: Any, call: Callable[[], OpCall]) -> Decision:
        return Decision.SAVE  # the region's bookkeeping keeps only the budget's choice

    def __call__(self, call: OpCall) -> Decision:
        return Decision.SAVE

    def __repr__(self) -> str:
        cost = "" if self.cost is None else f", cost={getattr(self.cost, '__name__', self.cost)}"
        return f"memory_budget({self.fraction:g}{cost})"


@dataclasses.dataclass(frozen=True)
class _Combined(Policy):
    """``left | right`` keeps what either keeps; ``left & right``, what both keep."""

    left: Policy
    right: Policy
    symbol: str

    def __post_init__(self) -> None:
        budget = self.left.budget or self.right.budget
        if budget is not None:
            raise TypeError(
                f"`remat`: {budget!r} chooses what to keep over a whole region, so it "
                f"cannot be combined with `{self.symbol}`. Use it alone, or inside `offload`."
            )
        object.__setattr__(self, "device", self.left.device or self.right.device)
        object.__setattr__(self, "by_op", self.left.by_op and self.right.by_op)

    def decide(self, op: Any, call: Callable[[], OpCall]) -> Decision:
        pick = max if self.symbol == "|" else min
        return pick(self.left.decide(op, call), self.right.decide(op, call))

    def __call__(self, call: OpCall) -> Decision:
        return self.decide(call.op, lambda: call)

    def __repr__(self) -> str:
        return f"({self.left!r} {self.symbol} {self.right!r})"


@dataclasses.dataclass(frozen=True)
class _Custom(Policy):
    """A user's callable on `OpCall`."""

    fn: Callable[[OpCall], Decision | bool]

    def __call__(self, call: OpCall) -> Decision | bool:
        return self.fn(call)

    def __repr__(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


NAMED: dict[str, Policy] = {
    repr(p): p for p in (save_nothing, save_everything, save_matmuls, save_matmuls_no_batch)
}


def resolve(policy: Any) -> Policy:
    """Turn what the user passed as ``policy=`` into a policy object."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        try:
            return NAMED[policy]
        except KeyError:
            valid = ", ".join(repr(name) for name in sorted(NAMED))
            raise ValueError(
                f"`remat`: unknown policy {policy!r}. Valid names: {valid}. "
                "Pass one of these, or a policy object from `remat.policies`."
            ) from None
    if _torch_private.is_aten_op(policy):
        raise TypeError(
            f"`remat`: `policy` got the aten op {policy!r}, not a policy. To keep its "
            f"outputs, pass `policy=remat.policies.save_ops({policy!r})`."
        )
    if isinstance(policy, torch.nn.Module) or getattr(policy, "__module__", None) == "torch":
        raise TypeError(
            f"`remat`: `policy` got {policy!r}, a torch function or module, not a policy. "
            "A custom policy is a callable taking an `OpCall` and returning a bool or a "
            "`Decision`; to keep an op's outputs, pass `remat.policies.save_ops(...)`."
        )
    if callable(policy) and not isinstance(policy, type):
        return _Custom(policy)
    raise TypeError(
        f"`remat`: `policy` must be a policy name (str), a policy object from "
        f"`remat.policies`, or a callable taking an `OpCall`; got {policy!r} of type "
        f"{type(policy).__name__}."
    )

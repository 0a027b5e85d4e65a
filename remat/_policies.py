"""Policies: what a remat region keeps for backward, and what it recomputes."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

__all__ = [
    "Decision",
    "OpCall",
    "Policy",
    "resolve",
    "save_everything",
    "save_nothing",
]


class Decision(enum.Enum):
    """What a policy decides for the output of one op."""

    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One aten op call inside a remat region, as a policy sees it.

    Attributes:
        op: the aten ``OpOverload`` that ran.
        args: its positional arguments.
        kwargs: its keyword arguments.
        output: what it returned.
        names: the tags (from `remat.name`) carried by its output.
    """

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    names: frozenset[str] = frozenset()


class Policy:
    """Base class of policy objects: data with a ``__call__`` on `OpCall`.

    Subclasses are frozen dataclasses. ``keeps_everything`` marks a policy under
    which the region is just ``fn`` (nothing is recomputed); ``per_op`` says
    whether the engine must show the policy every op of the forward.
    """

    keeps_everything: bool = False
    per_op: bool = True

    def __call__(self, call: OpCall) -> Decision | bool:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _SaveNothing(Policy):
    """Keep only the region's inputs; recompute every intermediate."""

    per_op = False

    def __call__(self, call: OpCall) -> Decision:
        return Decision.RECOMPUTE

    def __repr__(self) -> str:
        return "save_nothing"


@dataclasses.dataclass(frozen=True)
class _SaveEverything(Policy):
    """Keep what plain autograd keeps: the region costs what ``fn`` costs."""

    keeps_everything = True
    per_op = False

    def __call__(self, call: OpCall) -> Decision:
        return Decision.SAVE

    def __repr__(self) -> str:
        return "save_everything"


save_nothing: Policy = _SaveNothing()
save_everything: Policy = _SaveEverything()

_NAMED: dict[str, Policy] = {"save_nothing": save_nothing, "save_everything": save_everything}


def resolve(policy: str | Policy | Callable[[OpCall], Decision | bool]) -> Policy:
    """Turn what the user passed as ``policy=`` into a policy object."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        try:
            return _NAMED[policy]
        except KeyError:
            valid = ", ".join(repr(name) for name in sorted(_NAMED))
            raise ValueError(
                f"`remat`: unknown policy {policy!r}. Valid names: {valid}. "
                "Pass one of these, or a policy object from `remat.policies`."
            ) from None
    raise TypeError(
        f"`remat`: `policy` must be a policy name (str) or a policy object from "
        f"`remat.policies`, got {policy!r} of type {type(policy).__name__}."
    )

"""Regions under ``torch.compile``: traced into the graph as torch's checkpoint operator.

While Dynamo traces, a region does not run remat's eager engine (saved-tensor hooks
and a dispatch mode, which Dynamo cannot put in a graph). It becomes
``torch.utils.checkpoint.checkpoint(fn, ...)``, which Dynamo traces as its
``tag_activation_checkpoint`` higher-order operator; the policy becomes a selective
checkpoint context, asked per op while AOTAutograd traces the region, and the
partitioner honours its answers. Policies that need what the trace does not have
(`remat.name` tags, an op's output) raise when asked, naming remat.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from . import _torch_private
from ._policies import Decision, OpCall, Policy, save_all_but_names, save_names

__all__ = ["refuse_budget", "traced"]

_AS_TORCH = {
    Decision.SAVE: CheckpointPolicy.MUST_SAVE,
    Decision.RECOMPUTE: CheckpointPolicy.PREFER_RECOMPUTE,
    Decision.OFFLOAD: CheckpointPolicy.MUST_CPU_OFFLOAD,
}


def traced(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], policy: Policy, preserve_rng: bool
) -> Any:
    """``fn(*args, **kwargs)`` as one region of the graph being traced."""
    if _torch_private.traced_under_functorch():
        # torch's checkpoint operator does not run under torch.func transforms; the
        # graph Dynamo makes of a transform computes gradients itself: trace ``fn``.
        return fn(*args, **kwargs)
    unsupported = _needs_names(policy)
    if unsupported is not None:  # now, not while torch's checkpoint traces the region
        raise RuntimeError(
            f"`remat`: the policy {unsupported!r} keeps tensors tagged with `remat.name`, "
            "and under torch.compile remat cannot see the tags yet. Use a policy that "
            "decides by op (`save_matmuls`, `save_ops(...)`, or a callable reading "
            "`OpCall.op` and `OpCall.args`), or run this region without compiling it."
        )
    if policy.budget is not None and policy.per_op:
        raise _budget_refused(policy)
    context: dict[str, Any] = {}
    if policy.per_op:
        decide = functools.partial(_decide, policy)
        context["context_fn"] = functools.partial(create_selective_checkpoint_contexts, decide)
    context.update(_torch_private.checkpoint_options())
    return checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng, **context, **kwargs
    )


def refuse_budget(policy: Policy) -> NoReturn:
    """`memory_budget` where Dynamo runs a region's frame as is, after the graph break
    that raising in `traced` is. Called through ``torch.compiler.disable`` (Dynamo would
    compile its frame there), which imports Dynamo: not at remat's import."""
    raise _budget_refused(policy)


def _budget_refused(policy: Policy) -> RuntimeError:
    """`memory_budget` under torch.compile: it decides from an eager forward."""
    return RuntimeError(
        f"`remat`: {policy.budget!r} chooses what to keep from a region's eager forward, "
        "which torch.compile does not run. Compile with a policy that decides by op "
        "(`save_matmuls`, `save_ops(...)`), or use torch's own "
        "`torch._functorch.config.activation_memory_budget`, or run this region eagerly "
        "(`torch.compiler.disable`)."
    )


def _decide(policy: Policy, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The policy's decision for one op of the traced region, as torch's."""
    decision = policy.decide(op, lambda: OpCall(op, args, kwargs, _NOT_TRACED))
    if decision is Decision.OFFLOAD and policy.device is not None and policy.device.type != "cpu":
        raise RuntimeError(
            f"`remat`: under torch.compile, `offload` can move kept values to the CPU only, "
            f"not to {policy.device}."
        )
    return _AS_TORCH[decision]


def _needs_names(policy: Any) -> Policy | None:
    """The part of ``policy`` that reads `remat.name` tags, if any."""
    if isinstance(policy, (save_names, save_all_but_names)):
        return policy
    for field in ("policy", "left", "right"):  # offload's, and a combination's parts
        part = getattr(policy, field, None)
        found = _needs_names(part) if isinstance(part, Policy) else None
        if found is not None:
            return found
    return None


class _NotTraced:
    """`OpCall.output` while torch.compile traces: the op has not run, so there is none."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # protocols probed by inspect, copy, doctest
            raise AttributeError(name)
        raise RuntimeError(
            "`remat`: under torch.compile a policy sees each op before it runs, so "
            "`OpCall.output` does not exist. Decide from `OpCall.op` and `OpCall.args`, "
            "or run this region without compiling it."
        )

    def __repr__(self) -> str:
        return "<no output while torch.compile traces>"


_NOT_TRACED = _NotTraced()

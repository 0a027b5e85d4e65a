"""`remat`: the transform users apply to a function."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar, overload

import optree
import torch

from . import _hf, _torch_private
from ._compiled import refuse_budget, traced
from ._engine import Region, call_plan, flatten_call, running_region
from ._errors import compiled, scripted
from ._modules import ModuleState, owner_of, reachable
from ._policies import OpCall, Policy, resolve

__all__ = ["name", "remat"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")
_CHECKS = ("shapes", "none")

PolicyLike = str | Policy | Callable[[OpCall], Any]


@overload
def remat(
    fn: Callable[_P, _R],
    /,
    *,
    policy: PolicyLike = "save_nothing",
    preserve_rng: bool = True,
    check: Literal["shapes", "none"] = "shapes",
    namespace: str = "",
) -> Callable[_P, _R]: ...


@overload
def remat(
    fn: None = None,
    /,
    *,
    policy: PolicyLike = "save_nothing",
    preserve_rng: bool = True,
    check: Literal["shapes", "none"] = "shapes",
    namespace: str = "",
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...


def remat(
    fn: Callable[_P, _R] | None = None,
    /,
    *,
    policy: PolicyLike = "save_nothing",
    preserve_rng: bool = True,
    check: Literal["shapes", "none"] = "shapes",
    namespace: str = "",
) -> Any:
    """Make ``fn`` recompute its activations during backward instead of keeping them.

    The returned function computes exactly what ``fn`` computes. During its
    forward, autograd keeps only references to its tensor inputs (and what
    ``policy`` keeps); the first backward pass that needs an intermediate value
    re-runs ``fn`` once, up to the last value that pass needs.

    Args:
        fn: the function to wrap. Arguments and results may be any ``optree``
            pytrees of tensors and other values, positional or keyword.
            Omit it to get a decorator: ``@remat(policy=...)``.
        policy: what to keep for backward: a name (``"save_nothing"``,
            ``"save_everything"``, ``"save_matmuls"``, ``"save_matmuls_no_batch"``),
            a policy object from `remat.policies`, or a callable taking an
            `OpCall` and returning a bool or a `Decision`.
        preserve_rng: replay the forward's random numbers in the recompute, bit for
            bit; every generator ends where plain autograd leaves it. Without a
            per-op policy the recompute lends the captured states to the generators
            while it runs (see the RNG docs).
        check: ``"shapes"`` compares the shape, dtype, device and producing op of every
            recomputed value with the forward's; ``"none"`` skips that.
        namespace: an ``optree`` namespace: pytree nodes registered under it are walked
            like built-in containers, so the tensors inside are inputs (kept by
            reference, version-checked, given gradients).

    Returns:
        A function with ``fn``'s signature and metadata, plus ``__wrapped__``
        (``fn``) and ``policy`` (the resolved policy object).

    Raises:
        TypeError: ``fn`` is not callable, or ``policy`` or ``namespace`` has the wrong type.
        ValueError: ``policy`` names no known policy, or ``check`` is unknown.

    Examples:
        >>> import torch
        >>> from remat import remat
        >>> @remat
        ... def block(x, w):
        ...     return torch.tanh(x @ w).sin()
        >>> x, w = torch.randn(4, 3), torch.randn(3, 3, requires_grad=True)
        >>> block(x, w).sum().backward()
        >>> g = torch.func.grad(lambda w: block(x, w).sum())(w)
        >>> torch.equal(g, w.grad)
        True
    """
    resolved = resolve(policy)
    if check not in _CHECKS:
        raise ValueError(f"`remat`: `check` must be 'shapes' or 'none', got {check!r}.")
    if not isinstance(preserve_rng, bool):
        raise TypeError(f"`remat`: `preserve_rng` must be True or False, got {preserve_rng!r}.")
    if not isinstance(namespace, str):
        raise TypeError(
            f"`remat`: `namespace` must be an optree namespace (str), got {namespace!r}."
        )
    if fn is None:
        return functools.partial(
            remat, policy=resolved, preserve_rng=preserve_rng, check=check, namespace=namespace
        )
    if isinstance(fn, (staticmethod, classmethod)):
        kind = type(fn).__name__
        raise TypeError(
            f"`remat` got a {kind} object, which would bind as a plain method. Put `@remat` "
            f"below `@{kind}`, on the function itself."
        )
    if isinstance(fn, (torch.jit.ScriptModule, torch.jit.ScriptFunction, torch._C.ScriptMethod)):
        raise scripted(f"got a TorchScript {type(fn).__name__}")
    if _torch_private.compiled(fn):
        raise compiled("got a compiled function or module")
    if not callable(fn):
        raise TypeError(
            f"`remat` expected a callable `fn`, got {fn!r} of type {type(fn).__name__}. "
            "Use `@remat` on a function, or `remat(fn, policy=...)`."
        )
    compare = check == "shapes"

    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if resolved.keeps_everything or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # Dynamo traces the region into its graph
            return traced(fn, args, kwargs, resolved, preserve_rng)
        if resolved.budget is not None and resolved.per_op and _torch_private.compile_callback():
            torch.compiler.disable(refuse_budget)(resolved)
        with _torch_private.Hidden() as hidden:  # (a mode of the user's sees ``fn``'s ops only)
            leaves, structure, nodes = flatten_call((args, kwargs), namespace)
            inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
            reached = reachable(fn, leaves)
            owner = owner_of(fn, args[0] if args else None)
            modules = ModuleState.capture(owner, reached, leaves, structure)
            if resolved.per_op and modules is not None:
                modules.refuse_lazy(resolved)
            restored = modules.restored() if modules is not None else set()
            shared = call_plan((args, kwargs), leaves, nodes, namespace, restored)
            del nodes
            generators = []
            if preserve_rng:
                extra = modules.generators if modules is not None else []
                generators = [*reached.generators, *extra]
            region = Region(
                fn,
                owner,
                tuple(map(id, reached.modules)),
                (args, kwargs),
                (leaves, structure, shared),
                inputs,
                modules,
                generators,
                resolved,
                preserve_rng,
                compare,
                namespace,
                hidden,
            )
            check_caches = _hf.watch_caches(fn, leaves)
            out = region.forward()
            if check_caches is not None:
                check_caches()  # raises if the forward wrote to a Hugging Face cache
            return out

    if not torch.compiler.is_compiling():
        # (Dynamo breaks the graph copying a partial's ``__dict__``, as `remat.checkpoint`
        # and Hugging Face's layers make one per call; a wrapper made while it traces is
        # called there and then.)
        functools.update_wrapper(wrapper, fn)
    wrapper.policy = resolved  # type: ignore[attr-defined]
    return wrapper


def name(tree: _T, name: str) -> _T:
    """Tag the tensors of ``tree`` with ``name``, for `policies.save_names` and friends.

    An identity function: it returns ``tree`` itself. Inside a remat region the
    policy is asked again about the op that produced each tensor, now with
    ``name`` in `OpCall.names`; outside a region it does nothing.

    Examples:
        >>> import torch
        >>> from remat import remat, name, policies
        >>> @remat(policy=policies.save_names("h"))
        ... def block(x, w):
        ...     h = name(torch.tanh(x @ w), "h")
        ...     return (h @ w).sin()
        >>> block(torch.randn(2, 3), torch.randn(3, 3, requires_grad=True)).sum().backward()
    """
    if not isinstance(name, str):
        raise TypeError(f"`remat.name`: `name` must be a str, got {name!r}.")
    region = running_region()
    if region is not None and region.keeper is not None:
        leaves: list[Any] = optree.tree_leaves(tree)  # type: ignore[arg-type]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                region.keeper.tag(_torch_private.unwrap_all(leaf), frozenset((name,)))
    return tree

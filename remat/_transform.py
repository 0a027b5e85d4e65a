"""`remat`: the transform users apply to a function."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar, overload

import optree
import torch

from ._engine import Region
from ._modules import ModuleState
from ._policies import OpCall, Policy, resolve

__all__ = ["remat"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
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
) -> Callable[_P, _R]: ...


@overload
def remat(
    fn: None = None,
    /,
    *,
    policy: PolicyLike = "save_nothing",
    preserve_rng: bool = True,
    check: Literal["shapes", "none"] = "shapes",
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...


def remat(
    fn: Callable[_P, _R] | None = None,
    /,
    *,
    policy: PolicyLike = "save_nothing",
    preserve_rng: bool = True,
    check: Literal["shapes", "none"] = "shapes",
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
            ``"save_everything"``) or a policy object from `remat.policies`.
        preserve_rng: replay the forward's random numbers in the recompute,
            bit for bit, without touching the caller's generators.
        check: ``"shapes"`` compares the shape, dtype and device of every
            recomputed value with the forward's; ``"none"`` skips that.

    Returns:
        A function with ``fn``'s signature and metadata, plus ``__wrapped__``
        (``fn``) and ``policy`` (the resolved policy object).

    Raises:
        TypeError: ``fn`` is not callable, or ``policy`` has the wrong type.
        ValueError: ``policy`` names no known policy, or ``check`` is unknown.

    Example:
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
    if fn is None:
        return functools.partial(remat, policy=resolved, preserve_rng=preserve_rng, check=check)
    if not callable(fn):
        raise TypeError(
            f"`remat` expected a callable `fn`, got {fn!r} of type {type(fn).__name__}. "
            "Use `@remat` on a function, or `remat(fn, policy=...)`."
        )
    compare = check == "shapes"

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if resolved.keeps_everything or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        leaves: list[Any] = optree.tree_leaves((args, kwargs))  # type: ignore[arg-type]
        inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        modules = ModuleState.capture(fn, leaves)
        paths = functools.partial(_input_paths, fn, args, kwargs)
        region = Region(fn, args, kwargs, inputs, modules, paths, preserve_rng, compare)
        return region.forward()

    wrapper.policy = resolved  # type: ignore[attr-defined]
    return wrapper


def _input_paths(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str]:
    """Readable paths of the tensor leaves of ``(args, kwargs)``, like ``x['a'][0]``."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    tree: Any = (args, kwargs)
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    out = []
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            continue
        where, first, *rest = path
        if where == 1:
            head = str(first)
        elif first < len(names) and names[first] not in ("args", "self"):
            head = names[first]
        else:
            head = f"args[{first}]"
        out.append(f"`{head}{''.join(f'[{k!r}]' for k in rest)}`")
    return out

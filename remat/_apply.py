"""Models: `apply` makes submodules rematerialize; `checkpoint` is torch's call, done by remat."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
from torch.utils.checkpoint import noop_context_fn

from ._hf import WHILE_RECORDING, refuse_filled_cache, switched
from ._policies import resolve
from ._transform import PolicyLike, remat

__all__ = ["apply", "checkpoint", "unapply"]

_M = TypeVar("_M", bound=torch.nn.Module)
Where = None | type | tuple[type, ...] | Callable[[str, torch.nn.Module], bool]


class _Forward:
    """A module's ``forward``, rematerializing; `apply` stores it on the module itself.

    It holds the module, so ``copy.deepcopy`` and pickle give the copy a forward of
    the copy's own (a bound method, or a closure over one, would point back to the
    original). It calls the class's ``forward`` at each call, so a wrapper that swaps
    the module's class (FSDP2's ``fully_shard``) stays in the path; a ``forward`` set
    on the instance before (``inner``) is called instead, and put back by `unapply`.
    """

    __slots__ = ("inner", "module", "options")

    def __init__(
        self, module: torch.nn.Module, options: dict[str, Any], inner: Callable[..., Any] | None
    ) -> None:
        self.module, self.options, self.inner = module, options, inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return remat(self.inner, **self.options)(*args, **kwargs)
        # The class's function, the module its first argument: a bound method made here
        # is what Dynamo cannot trace (``function.__get__``) or guards on by a wrong name.
        forward = type(self.module).forward
        return remat(forward, **self.options)(self.module, *args, **kwargs)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"remat({type(self.module).__name__}.forward, {options})"

    @property
    def __signature__(self) -> inspect.Signature:
        """The forward's own: code reads it to choose what to pass (Hugging Face's
        ``generate`` builds ``position_ids`` only for a ``forward`` that names them)."""
        forward = self.inner or type(self.module).forward.__get__(self.module)
        return inspect.signature(forward)


class _Checked(_Forward):
    """A Hugging Face layer's ``forward`` under `apply`: the class's own, which checkpoints
    through the layer's switch, once the switch is seen to be remat's still (`_Refusal`
    guards the models `apply` was given, not the models above them)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        func = self.module.__dict__.get("_gradient_checkpointing_func")
        if not (isinstance(func, functools.partial) and func.func is checkpoint):
            inner = func.func if isinstance(func, functools.partial) else func
            shown = f"`{inner.__module__}.{inner.__qualname__}`" if callable(inner) else repr(inner)
            raise RuntimeError(
                f"`remat.apply` made this {type(self.module).__name__} rematerialize through "
                f"Hugging Face's checkpointing switch, which has since been set to {shown} "
                "(by Hugging Face's switch on a model above the one `remat.apply` was given, "
                f"for one). {_SWITCHING} To go back to remat, call `remat.apply` again."
            )
        if self.module.training and torch.is_grad_enabled():
            refuse_filled_cache(self.module, args, kwargs)
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class _Refusal:
    """A Hugging Face model's ``_set_gradient_checkpointing`` under `apply`: it raises.

    Hugging Face's ``activation_checkpointing_enable`` and ``_disable`` (``gradient_...``
    in transformers 5.17) set every layer's switch through it, replacing remat's checkpoint
    function without a word.
    """

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(
        self, enable: bool = True, gradient_checkpointing_func: Any = None, **_: Any
    ) -> None:
        layers = {
            type(m).__name__
            for m in self.module.modules()
            if isinstance(m.__dict__.get("forward"), _Checked)
        }
        raise RuntimeError(
            f"`remat.apply` made the {', '.join(sorted(layers))} layers of this "
            f"{type(self.module).__name__} rematerialize through Hugging Face's checkpointing "
            f"switch, which cannot be switched {'on' if enable else 'off'} here. {_SWITCHING}"
        )


_SWITCHING = (
    "Hugging Face's `activation_checkpointing_enable`, `gradient_checkpointing_enable` (which "
    "`Trainer` calls for `TrainingArguments(gradient_checkpointing=True)`) and their "
    "`_disable` replace remat's checkpoint function. remat checkpoints the layers already: "
    "leave that option False. To use Hugging Face's checkpointing instead, call "
    "`remat.unapply(model)` first."
)


def _refuse_switching(model: torch.nn.Module) -> None:
    """Guard each Hugging Face model in ``model`` whose layers `apply` switched, and only those."""
    for module in model.modules():
        if not hasattr(type(module), "_set_gradient_checkpointing"):
            continue
        guarded = isinstance(module.__dict__.get("_set_gradient_checkpointing"), _Refusal)
        applied = any(isinstance(m.__dict__.get("forward"), _Checked) for m in module.modules())
        if applied and not guarded:
            hf: Any = module
            hf._set_gradient_checkpointing = _Refusal(module)
        elif guarded and not applied:
            del module._set_gradient_checkpointing


def apply(
    model: _M,
    where: Where = None,
    *,
    policy: PolicyLike = "save_nothing",
    preserve_rng: bool = True,
    check: Literal["shapes", "none"] = "shapes",
) -> _M:
    """Make the submodules of ``model`` that match ``where`` rematerialize, in place.

    Each matching module's forward becomes a remat region (its forward hooks stay
    outside it). Parameter and buffer names do not change, and neither does
    ``state_dict()``; ``copy.deepcopy``, pickle and ``torch.save`` give an independent
    model that still rematerializes. Applying again replaces the options; `unapply`
    undoes it. A match inside another match is left alone: its outermost match
    recomputes it already.

    Hugging Face layers (``GradientCheckpointingLayer``) are switched to remat through
    their own checkpointing switch, as are the models above them that have it: in
    training, while autograd records, they rematerialize and drop the KV cache as
    Hugging Face's own checkpointing does (``use_cache=False``); without autograd
    (``generate()``) they run as plain, with the cache. Hugging Face's
    ``activation_checkpointing_enable`` (which ``Trainer`` calls for
    ``gradient_checkpointing=True``) and ``_disable`` then raise: `unapply` first.

    Args:
        model: the model; it is changed in place and returned.
        where: which submodules: ``None`` (the model itself), an ``nn.Module``
            subclass or a tuple of them, or a callable ``(qualified_name, module) -> bool``.
        policy: as for `remat`.
        preserve_rng: as for `remat`.
        check: as for `remat`.

    Raises:
        TypeError: ``model`` is not a module, or ``where`` has the wrong type.
        ValueError: ``where`` matches no submodule.

    Examples:
        >>> import torch, remat
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> remat.apply(model, torch.nn.Linear, policy="save_matmuls") is model
        True
        >>> model(torch.randn(2, 4)).sum().backward()
    """
    options: dict[str, Any] = {
        "policy": resolve(policy),
        "preserve_rng": preserve_rng,
        "check": check,
    }
    remat(_identity, **options)  # checks the options now, not at the first call
    matches = _matching(model, where, "apply")
    hugging_face = switched(model, matches)
    # torch's names, as Hugging Face calls `checkpoint(fn, *args)` and passes it no options.
    as_torch = {
        "policy": options["policy"],
        "preserve_rng_state": preserve_rng,
        "determinism_check": "default" if check == "shapes" else "none",
    }
    for module in hugging_face:
        # Hugging Face's own switch, as `activation_checkpointing_enable` sets it: the
        # layers call `checkpoint`, and they and the models above them drop the cache,
        # but only while autograd records (Hugging Face's flag says "in training").
        hf: Any = module
        hf._gradient_checkpointing_func = functools.partial(checkpoint, **as_torch)
        hf.gradient_checkpointing = WHILE_RECORDING
    for module in matches:
        inner = module.__dict__.get("forward")
        if isinstance(inner, _Forward):
            inner = inner.inner
        kind = _Checked if any(module is m for m in hugging_face) else _Forward
        module.forward = kind(module, options, inner)
    _refuse_switching(model)
    return model


def unapply(model: _M, where: Where = None) -> _M:
    """Undo `apply` on the submodules that match ``where`` (default: all of them).

    Hugging Face layers are left with their checkpointing off.
    """
    test = (lambda *_: True) if where is None else where
    matches = _matching(model, test, "unapply", outermost=False, required=False)
    for module in matches:
        forward = module.__dict__.get("forward")
        if isinstance(forward, _Forward):
            del module.forward
            if forward.inner is not None:
                module.forward = forward.inner
    for module in switched(model, matches):
        func = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, functools.partial) and func.func is checkpoint:
            hf: Any = module
            del hf._gradient_checkpointing_func
            hf.gradient_checkpointing = False
    _refuse_switching(model)
    return model


def _matching(
    model: torch.nn.Module,
    where: Where,
    caller: str,
    outermost: bool = True,
    required: bool = True,
) -> list[torch.nn.Module]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"`remat.{caller}`: `model` must be an nn.Module, got {type(model).__name__}. "
            "To rematerialize a function, use `remat.remat(fn)`."
        )
    test = _test(where, caller)
    found: list[torch.nn.Module] = []
    prefixes: list[str] = []  # of the matches' submodules' names
    for qualified, module in model.named_modules():
        if outermost and any(qualified.startswith(prefix) for prefix in prefixes):
            continue
        if test(qualified, module):
            found.append(module)
            prefixes.append(f"{qualified}." if qualified else "")
    if required and not found:
        kinds = sorted({type(m).__name__ for m in model.modules()})
        shown = where.__name__ if isinstance(where, type) else repr(where)
        raise ValueError(
            f"`remat.{caller}`: `where={shown}` matches no submodule of the model. "
            f"Its module classes are: {', '.join(kinds)}."
        )
    return found


def _test(where: Where, caller: str) -> Callable[[str, torch.nn.Module], bool]:
    if where is None:
        return lambda qualified, _: qualified == ""
    classes: tuple[Any, ...] = where if isinstance(where, tuple) else (where,)
    if all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
        return lambda _, module: isinstance(module, classes)
    if isinstance(where, torch.nn.Module):
        raise TypeError(
            f"`remat.{caller}`: `where` got a module instance, {type(where).__name__}(...); "
            f"pass its class, `where={type(where).__name__}`, to match every such submodule."
        )
    if callable(where) and not isinstance(where, (type, tuple)):
        return lambda qualified, module: bool(where(qualified, module))
    raise TypeError(
        f"`remat.{caller}`: `where` must be None, an nn.Module subclass or a tuple of them, "
        f"or a callable (qualified_name, module) -> bool; got {where!r}."
    )


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    policy: PolicyLike = "save_nothing",
    use_reentrant: bool | None = None,
    context_fn: Any = None,
    determinism_check: str = "default",
    debug: bool = False,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``,
    done by remat: ``remat(function, policy=policy)(*args, **kwargs)``.

    It takes torch's keyword options: ``preserve_rng_state`` (remat's
    ``preserve_rng``), ``determinism_check`` (``"default"`` is ``check="shapes"``,
    ``"none"`` is ``check="none"``), ``debug`` (runs under `remat.debug`), and
    ``early_stop`` (remat always stops early; ``False`` changes no value, so it is
    accepted and ignored). Every other keyword goes to ``function``. It works as the
    ``checkpoint_fn`` of torch's ``checkpoint_wrapper``.

    Raises:
        ValueError: ``use_reentrant=True``, a ``context_fn`` (but torch's default,
            ``noop_context_fn``), or an unknown ``determinism_check``: each names what to
            use instead.
    """
    if use_reentrant:
        raise ValueError(
            "`remat.checkpoint`: `use_reentrant=True` is torch's older autograd.Function "
            "checkpoint, which remat does not emulate. Drop the argument (remat is "
            "non-reentrant, like `use_reentrant=False`)."
        )
    if context_fn is not None and context_fn is not noop_context_fn:
        raise ValueError(
            "`remat.checkpoint`: `context_fn` (torch's selective checkpointing) is not "
            "supported; pass `policy=` instead, for example `policy='save_matmuls'` or "
            "`remat.policies.save_ops(...)` (see remat.policies)."
        )
    checks: dict[str, Literal["shapes", "none"]] = {"default": "shapes", "none": "none"}
    if determinism_check not in checks:
        raise ValueError(
            f"`remat.checkpoint`: `determinism_check` must be 'default' or 'none', got "
            f"{determinism_check!r}."
        )
    wrapped = remat(
        function,
        policy=policy,
        preserve_rng=bool(preserve_rng_state),
        check=checks[determinism_check],
    )
    if debug:
        from ._errors import debug as debugging

        with debugging():
            return wrapped(*args, **kwargs)
    return wrapped(*args, **kwargs)


def _identity(x: Any) -> Any:
    return x

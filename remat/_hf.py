"""Hugging Face transformers: the checkpointing switch `apply` sets, and the caches a region
must not write. transformers is never imported here: only looked up, if it is loaded."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from ._errors import RecomputeError

__all__ = [
    "WHILE_RECORDING",
    "checkpointing_layer",
    "refuse_filled_cache",
    "switched",
    "watch_caches",
]


class _WhileRecording:
    """The value `apply` gives Hugging Face's ``gradient_checkpointing`` flags: true only
    while gradients are enabled (while autograd records, but for a call in which nothing
    requires grad).

    Hugging Face reads the flag with ``self.training`` alone (its layers up to transformers
    5.23; GPT-2's model in every version), so a model in training mode would drop the KV
    cache under ``torch.no_grad()`` too, and ``generate()`` would lose its context (GPT-2's
    model passes its blocks no cache, and each layer drops the one it gets). Without
    autograd there is nothing to recompute, and the cache is kept.
    """

    __slots__ = ()

    def __bool__(self) -> bool:
        return torch.is_grad_enabled()

    def __repr__(self) -> str:
        return "WHILE_RECORDING"

    def __reduce__(self) -> str:
        return "WHILE_RECORDING"  # copies and pickles are this one object


WHILE_RECORDING = _WhileRecording()


def checkpointing_layer() -> type | None:
    """Hugging Face's layer base class, if transformers is loaded."""
    layers = sys.modules.get("transformers.modeling_layers")
    return getattr(layers, "GradientCheckpointingLayer", None)


def switched(model: torch.nn.Module, matches: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The Hugging Face layers among ``matches``, and the modules above them with the same
    switch (a model drops the KV cache by its own flag: GPT-2 passes it positionally)."""
    layer = checkpointing_layer()
    if layer is None:
        return []
    layers = {id(m) for m in matches if isinstance(m, layer)}
    if not layers:
        return []
    return [
        m
        for m in model.modules()
        if id(m) in layers
        or (hasattr(m, "gradient_checkpointing") and any(id(s) in layers for s in m.modules()))
    ]


def refuse_filled_cache(
    layer: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raise if a Hugging Face layer under `apply`, about to drop its KV cache (in training,
    while autograd records), is given one that holds positions for it: it would attend
    without them (a call that trains on a continuation of a prefilled prompt). Positions
    that layers not under `apply` wrote in this call are theirs, not this layer's."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None or getattr(layer, "_can_checkpoint_with_cache", False):
        return
    index = next(
        (m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)),
        None,
    )
    for value in (*args, *kwargs.values()) if index is not None else ():
        if not isinstance(value, cache_utils.Cache):
            continue
        try:
            held = value.get_seq_length(index)
        except ValueError:  # (a layer of another kind there: a linear attention's state)
            continue
        if held > 0:
            raise RecomputeError(
                f"`remat.apply`: this {type(layer).__name__} was given a Hugging Face cache "
                f"that holds {held} positions for it while autograd records. Hugging Face's "
                "checkpointing, which `remat.apply` switches on for the layer, drops the "
                "cache there (as `activation_checkpointing_enable` does): the layer would "
                "attend without those positions. Train on the whole sequence in one call "
                "(the prompt in `input_ids`, no cache), or fill and read the cache under "
                "`torch.no_grad()`."
            )


def watch_caches(fn: Callable[..., Any], leaves: list[Any]) -> Callable[[], None] | None:
    """A check to call when the region's forward returns, if it was given a Hugging Face
    cache (an argument, or bound by `functools.partial`, as Hugging Face's layers call
    their checkpoint function); None otherwise.

    The check raises if the forward wrote to a cache: the recompute would run that write
    again (a Python-level update, invisible to autograd) and append the keys and values
    twice. A cache the region only reads passes.
    """
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return None
    cache = cache_utils.Cache
    bound = [*fn.args, *fn.keywords.values()] if isinstance(fn, functools.partial) else []
    caches = [c for c in [*leaves, *bound] if isinstance(c, cache)]
    if not caches:
        return None
    before = [_state(c, cache_utils.__name__) for c in caches]

    def check() -> None:
        for c, state in zip(caches, before, strict=True):
            if not _same(state, _state(c, cache_utils.__name__)):
                raise _wrote(fn, c)

    return check


def _state(cache: Any, module: str) -> list[Any]:
    """What a write to ``cache`` changes: its tensors (the objects, and their versions) and
    plain values, through the lists, dicts and objects of transformers' cache module."""
    found: list[Any] = []
    seen: set[int] = set()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.extend((x, x._version))
        elif isinstance(x, (list, tuple)):
            found.append(len(x))
            for item in x:
                walk(item)
        elif isinstance(x, dict):
            found.append(len(x))
            for key, item in x.items():
                found.append(key)
                walk(item)
        elif (x is cache or type(x).__module__ == module) and hasattr(x, "__dict__"):
            if id(x) not in seen:
                seen.add(id(x))
                walk(vars(x))
        else:
            found.append(x)

    walk(cache)
    return found


def _same(before: list[Any], after: list[Any]) -> bool:
    return len(before) == len(after) and all(
        a is b or (not isinstance(a, torch.Tensor) and type(a) is type(b) and a == b)
        for a, b in zip(before, after, strict=True)
    )


def _wrote(fn: Callable[..., Any], cache: Any) -> RecomputeError:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    where = getattr(inner, "__qualname__", repr(inner))
    return RecomputeError(
        f"`remat`: the region around `{where}` wrote to the Hugging Face cache it was given "
        f"({type(cache).__name__}): state outside the region, which its recompute would "
        "write a second time (the keys and values appended twice). Put the region around "
        "the whole layer instead (`remat.apply(model, LayerClass)` with the model's "
        "decoder layer class: it drops the cache while training, as Hugging Face's own "
        "checkpointing does), or do not pass a cache while training (`use_cache=False`)."
    )

"""Functional RNG capture: the recompute draws the forward's random numbers.

Capture is lazy: the state of a generator is copied (as a value) just before the
first random op of the region that uses it, whether it is an explicit
``generator=`` or the default generator of the op's device. The recompute runs
each random op on a private clone made from that value, so the caller's
generators are never touched and end where plain autograd would leave them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["RngCapture", "is_random"]

_RANDOM: dict[Any, bool] = {}
_local = threading.local()


def is_random(func: Any) -> bool:
    """Whether an aten op draws from a generator (cached per overload)."""
    random = _RANDOM.get(func)
    if random is None:
        random = _RANDOM[func] = torch.Tag.nondeterministic_seeded in func.tags
    return random


def _op_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.get_default_device()


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


def _op_generator(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | None:
    generator = kwargs.get("generator")
    if generator is not None:
        return generator
    return _default_generator(_op_device(args, kwargs))


def _active(generator: torch.Generator) -> torch.Generator:
    """The generator an op really draws from: a replay clone inside a recompute."""
    for clones in reversed(getattr(_local, "replays", ())):
        clone = clones.get(generator)
        if clone is not None:
            return clone
    return generator


class RngCapture:
    """Generator states a region consumed, captured at its first random op."""

    __slots__ = ("states",)

    def __init__(self) -> None:
        self.states: dict[torch.Generator, torch.Tensor] = {}

    def before(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        generator = _op_generator(args, kwargs)
        if generator is not None and generator not in self.states:
            self.states[generator] = _active(generator).get_state()

    def replay(self) -> RngReplay:
        clones = {}
        for generator, state in self.states.items():
            clone = torch.Generator(device=generator.device)
            clone.set_state(state)
            clones[generator] = clone
        return RngReplay(clones)


class RngReplay:
    """Runs random ops of one recompute on clones of the forward's generators."""

    __slots__ = ("clones",)

    def __init__(self, clones: dict[torch.Generator, torch.Generator]) -> None:
        self.clones = clones

    def __enter__(self) -> RngReplay:
        if not hasattr(_local, "replays"):
            _local.replays = []
        _local.replays.append(self.clones)
        return self

    def __exit__(self, *exc: object) -> None:
        _local.replays.pop()

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        generator = _op_generator(args, kwargs)
        clone = self.clones.get(generator) if generator is not None else None
        if clone is None:
            return func(*args, **kwargs)
        if any(arg.name == "generator" for arg in func._schema.arguments):
            return func(*args, **{**kwargs, "generator": clone})
        # No `generator=` in the schema (CUDA's fused native_dropout): lend the
        # clone's state to the default generator for this one op.
        assert generator is not None
        caller_state = generator.get_state()
        generator.set_state(clone.get_state())
        try:
            out = func(*args, **kwargs)
            clone.set_state(generator.get_state())
        finally:
            generator.set_state(caller_state)
        return out

"""What a policy keeps: op outputs held by op index, and only if a backward reads them.

During the forward every aten op of the region gets an index. The policy decides
for each op's outputs (random, in-place and view ops are always recomputed); a
kept output is held as a detached alias, and the recompute replays it at the same
index instead of running the op. When the forward ends, a kept value is released
unless a backward needs it: autograd saved it directly, or an op the recompute
will execute (one before the last value to rebuild) reads it. A kept op that
nothing reads is not run again either: the recompute gets an empty placeholder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._policies import Decision, OpCall, Policy, as_decision
from ._rng import is_random

__all__ = ["Keeper", "Replayer"]


def _tensors(values: Any) -> list[torch.Tensor]:
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _map(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (list, tuple)):
        return type(out)(fn(t) if isinstance(t, torch.Tensor) else t for t in out)
    return out


def storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Which memory ``t`` shows: equal keys, equal views of the same data."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


class Keeper:
    """The forward side: the policy's decisions, and which kept values a backward needs."""

    __slots__ = (
        "count",
        "kept",
        "keys",
        "keys_of",
        "offload",
        "ops",
        "packed",
        "placeholders",
        "policy",
        "produced",
        "readers",
        "rebuilt_before",
        "sources",
        "tags",
    )

    def __init__(self, policy: Policy, sources: bool = False) -> None:
        self.policy = policy
        self.count = 0
        self.ops: list[Any] = []
        self.kept: dict[int, tuple[Any, int]] = {}  # op index -> (detached output, version)
        self.keys: dict[tuple[Any, ...], int] = {}  # storage key of a kept output -> index
        self.keys_of: dict[int, list[tuple[Any, ...]]] = {}
        self.readers: dict[int, list[int]] = {}
        self.produced: dict[int, int] = {}  # id(output) -> op index, during the forward
        self.packed: set[int] = set()
        self.placeholders: dict[int, Any] = {}
        self.tags: dict[int, frozenset[str]] = {}
        self.offload: dict[int, tuple[Any, torch.device]] = {}
        self.sources: dict[int, str] | None = {} if sources else None
        self.rebuilt_before = 0

    def after(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Record one forward op: which kept values it read, and the policy's decision."""
        index = self.count
        self.count += 1
        self.ops.append(func)
        for t in _tensors(args) + _tensors(kwargs.values()):
            source = self.produced.get(id(t))
            if source is not None and source in self.kept:
                self.readers.setdefault(source, []).append(index)
        outputs = _tensors(out if isinstance(out, (list, tuple)) else (out,))
        for t in outputs:
            self.produced[id(t)] = index
        if not outputs or is_random(func) or func.is_view or func._schema.is_mutable:
            return
        decision = self.policy.decide(func, lambda: OpCall(func, args, kwargs, out))
        self._apply(index, decision, out)

    def tag(self, t: torch.Tensor, names: frozenset[str]) -> None:
        """`remat.name`: ask the policy again about the op that produced ``t``."""
        index = self.produced.get(id(t))
        if index is None:
            return
        names = self.tags.get(index, frozenset()) | names
        self.tags[index] = names
        func = self.ops[index]
        decision = as_decision(self.policy, self.policy(OpCall(func, (), {}, t, names)), func)
        self._drop(index)
        self._apply(index, decision, t)

    def _apply(self, index: int, decision: Decision, out: Any) -> None:
        if decision is Decision.RECOMPUTE:
            return
        alias = _map(out, torch.Tensor.detach)
        self.kept[index] = (alias, _version(out))
        for t in _tensors(alias if isinstance(alias, (list, tuple)) else (alias,)):
            if not _is_wrapped(t):
                key = storage_key(t)
                self.keys[key] = index
                self.keys_of.setdefault(index, []).append(key)
        if decision is Decision.OFFLOAD:
            self.offload[index] = (None, self.policy.device or torch.device("cpu"))
        if self.sources is not None:
            from ._errors import source_line

            self.sources[index] = source_line()

    def _drop(self, index: int) -> None:
        self.kept.pop(index, None)
        self.offload.pop(index, None)
        self.packed.discard(index)
        for key in self.keys_of.pop(index, ()):
            if self.keys.get(key) == index:
                del self.keys[key]

    def note_saved(self, t: torch.Tensor) -> None:
        """Autograd saves ``t`` for a handle: ops so far re-run, and a kept ``t`` is read."""
        self.rebuilt_before = self.count
        if self.keys and not _is_wrapped(t):
            index = self.keys.get(storage_key(t))
            if index is not None:
                self.packed.add(index)

    def finish(self) -> None:
        """End of forward: release what no backward reads; offload what the policy asked."""
        self.produced.clear()
        mutated = {i for i, (out, version) in self.kept.items() if _version(out) != version}
        for index in mutated:
            self._drop(index)
        for index in list(self.kept):
            reads = self.readers.get(index, ())
            if index in self.packed or any(
                r < self.rebuilt_before and r not in self.kept for r in reads
            ):
                if index in self.offload:
                    out, _ = self.kept[index]
                    device = self.offload[index][1]
                    self.kept[index] = (_move(out, device), 0)
                    self.offload[index] = (_device(out), device)
                continue
            out, _ = self.kept[index]
            self._drop(index)
            if index < self.rebuilt_before:
                self.placeholders[index] = _map(out, _empty_like)
        self.readers.clear()

    def value(self, index: int) -> Any:
        """A kept value, on its own device, as a fresh alias autograd may attach to."""
        out, _ = self.kept[index]
        if index in self.offload:
            return _move(out, self.offload[index][0])
        return _map(out, torch.Tensor.detach)


class Replayer:
    """The recompute side: kept values and placeholders, at their op index."""

    __slots__ = ("count", "keeper")

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper
        self.count = 0

    def next(self) -> tuple[bool, Any]:
        index = self.count
        self.count += 1
        if index in self.keeper.kept:
            return True, self.keeper.value(index)
        placeholder = self.keeper.placeholders.get(index)
        return placeholder is not None, placeholder


def _version(out: Any) -> int:
    return sum(t._version for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)))


def _is_wrapped(t: torch.Tensor) -> bool:
    from ._torch_private import wrapper_level

    return wrapper_level(t) != -1


def _device(out: Any) -> torch.device:
    return _tensors(out if isinstance(out, (list, tuple)) else (out,))[0].device


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def _move(out: Any, device: torch.device) -> Any:
    def move(t: torch.Tensor) -> torch.Tensor:
        pin = t.device.type == "cuda" and device.type == "cpu"
        copy = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
        return copy.copy_(t, non_blocking=pin or device.type == "cuda")

    return _map(out, move)

"""What a policy keeps, by op index, and only what a backward reads.

During the forward every aten op of the region gets an index, and the forward
records which earlier ops each op read. The policy decides for each op's outputs
(random, in-place and view ops are always recomputed). When the forward ends,
the ops the recompute must run are found backwards from the values it rebuilds,
stopping at kept ops: those kept values are held, every other one is released,
and every op not needed is skipped in the recompute (it gets an empty
placeholder). A kept op is never run again: the recompute replays its value.
Ops that Python itself reads (non-tensor results, such as ``.item()``), random
and in-place ops always run, with what they read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _torch_private
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


def _outputs(out: Any) -> list[torch.Tensor]:
    return _tensors(out if isinstance(out, (list, tuple)) else (out,))


def _map(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (list, tuple)):
        return type(out)(fn(t) if isinstance(t, torch.Tensor) else t for t in out)
    return out


def storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Which memory ``t`` shows (equal keys: equal views of the same data), if it has any.

    Forward-mode AD makes zero tangents with no storage at all.
    """
    if t._is_zerotensor():
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


aten = torch.ops.aten
# Ops that read only the shape, dtype and device of their tensor arguments.
_METADATA_ONLY = frozenset(
    {
        aten.empty_like,
        aten.zeros_like,
        aten.ones_like,
        aten.full_like,
        aten.rand_like,
        aten.randn_like,
        aten.randint_like,
        aten.new_empty,
        aten.new_empty_strided,
        aten.new_zeros,
        aten.new_ones,
        aten.new_full,
    }
)


_READS_METADATA, _ALWAYS_RUNS, _VIEW, _DECIDED = range(4)
_KINDS: dict[Any, int] = {}


def _kind(func: Any) -> int:
    """How the bookkeeping treats an op (cached per overload)."""
    if func.overloadpacket in _METADATA_ONLY:
        return _READS_METADATA
    if is_random(func) or func._schema.is_mutable:
        return _ALWAYS_RUNS
    return _VIEW if func.is_view else _DECIDED


def _version(out: Any) -> int:
    return sum(t._version for t in _outputs(out))


class Keeper:
    """The forward side: the policy's decisions, and what the recompute needs."""

    __slots__ = (
        "count",
        "deps",
        "error",
        "kept",
        "keys",
        "metas",
        "offload",
        "ops",
        "policy",
        "produced",
        "rebuilt_before",
        "roots",
        "skip",
        "skips",
        "sources",
        "tags",
        "wanted",
    )

    def __init__(self, policy: Policy, sources: bool = False) -> None:
        self.policy = policy
        self.count = 0
        self.ops: list[Any] = []
        self.deps: list[tuple[int, ...]] = []  # op index -> indices of the ops it read
        self.metas: list[Any] = []  # op index -> output shapes, for placeholders
        self.roots: list[int] = []  # ops that always run in the recompute
        self.produced: dict[int, int] = {}  # id(output) -> op index, during the forward
        self.kept: dict[int, tuple[Any, int]] = {}  # op index -> (output, version)
        self.keys: dict[tuple[Any, ...], int] = {}  # storage key of a kept output -> index
        self.wanted: set[int] = set()  # ops whose outputs autograd saved for a rebuild
        self.skip: dict[int, Any] = {}  # op index -> placeholder metadata, after finish
        self.tags: dict[int, frozenset[str]] = {}
        self.offload: dict[int, tuple[torch.device, torch.device]] = {}
        self.sources: dict[int, str] | None = {} if sources else None
        self.error: Exception | None = None
        self.rebuilt_before = 0
        self.skips = True

    def after(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Record one forward op: what it read, and the policy's decision on its outputs."""
        index = self.count
        self.count += 1
        self.ops.append(func)
        produced = self.produced
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        if kind == _READS_METADATA:
            self.deps.append(())
        else:
            reads: set[int] = set()
            for arg in (*args, *kwargs.values()) if kwargs else args:
                if isinstance(arg, (list, tuple)):
                    reads.update(produced[id(a)] for a in arg if id(a) in produced)
                elif id(arg) in produced:
                    reads.add(produced[id(arg)])
            self.deps.append(tuple(reads))
        if isinstance(out, torch.Tensor):
            produced[id(out)] = index
            self.metas.append(_Shape(out))
        elif isinstance(out, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in out):
            for t in out:
                produced[id(t)] = index
            self.metas.append(type(out)(map(_Shape, out)) if out else None)
        else:
            self.metas.append(None)
        if kind == _ALWAYS_RUNS or self.metas[-1] is None:
            self.roots.append(index)
            return
        if kind == _VIEW:
            return
        try:
            decision = self.policy.decide(func, lambda: OpCall(func, args, kwargs, out))
        except TypeError as error:  # raised when the forward ends: an operator would mask it
            self.error = self.error or error
            return
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
        self.kept.pop(index, None)
        self.offload.pop(index, None)
        if index not in self.roots and not func.is_view:
            self._apply(index, decision, t)

    def _apply(self, index: int, decision: Decision, out: Any) -> None:
        if decision is Decision.RECOMPUTE:
            return
        self.kept[index] = (out, _version(out))
        for t in _outputs(out):
            key = storage_key(t)
            if key is not None:
                self.keys[key] = index
        if decision is Decision.OFFLOAD:
            target = self.policy.device or torch.device("cpu")
            self.offload[index] = (_outputs(out)[0].device, target)
        if self.sources is not None:
            from ._errors import source_line

            self.sources[index] = source_line()

    def note_saved(self, t: torch.Tensor) -> None:
        """Autograd saves ``t`` for a handle: the recompute runs up to here and rebuilds it."""
        self.rebuilt_before = self.count
        plain = _torch_private.unwrap_all(t)
        index = self.produced.get(id(plain))
        if index is None and self.keys:
            index = self.keys.get(storage_key(plain))  # type: ignore[arg-type]
        if index is not None:
            self.wanted.add(index)

    def finish(self, skip: bool = True) -> None:
        """End of forward: hold what the recompute reads, skip what it does not need.

        ``skip=False`` (under forward-mode AD, whose tangents ride on values the
        dispatcher cannot see) runs every op again except kept ones that are needed.
        """
        if self.error is not None:
            raise self.error
        self.skips = skip
        needed = self._needed()
        with _torch_private.functorch_cleared():
            for index in list(self.kept):
                out, version = self.kept.pop(index)
                if index in needed and _version(out) == version:
                    alias = _map(out, torch.Tensor.detach)  # shares out's version counter
                    if index in self.offload:
                        alias = _move(alias, self.offload[index][1])
                    self.kept[index] = (alias, _version(alias))
        self._skip(needed)
        self.produced, self.keys = {}, {}

    def release(self) -> None:
        """After a recompute: drop every kept value, as nothing may read them again.

        Only a second backward through the same graph (``retain_graph=True``) could;
        it then runs those ops again, so the ops they read are no longer skipped.
        """
        if self.kept:
            self.kept.clear()
            self._skip(self._needed())

    def _needed(self) -> set[int]:
        """Ops the recompute must run: backwards from rebuilt values, stopping at kept ones."""
        limit = self.rebuilt_before
        needed: set[int] = set()
        stack = [i for i in self.wanted if i < limit] + [r for r in self.roots if r < limit]
        while stack:
            index = stack.pop()
            if index in needed:
                continue
            needed.add(index)
            if index not in self.kept:
                stack.extend(self.deps[index])
        return needed

    def _skip(self, needed: set[int]) -> None:
        limit = self.rebuilt_before
        if self.skips:
            self.skip = {i: self.metas[i] for i in range(limit) if i not in needed}

    def skip_shapes(self) -> list[_Shape]:
        shapes: list[_Shape] = []
        for meta in self.skip.values():
            shapes.extend([meta] if isinstance(meta, _Shape) else meta)
        return shapes

    def value(self, index: int) -> Any:
        """A kept value, on its own device, as a fresh alias autograd may attach to."""
        alias, version = self.kept[index]
        if _version(alias) != version:
            raise RuntimeError(
                f"`remat`: a value the policy kept (output of {self.ops[index]}) was modified "
                "in place after the forward; its gradients would be wrong. Clone it before "
                "modifying it."
            )
        if index in self.offload:
            return _move(alias, self.offload[index][0])
        return _map(alias, torch.Tensor.detach)


class Replayer:
    """The recompute side: kept values and placeholders, at their op index.

    It runs inside the recompute's dispatch mode, below torch.func's levels.
    Placeholders of one recompute are views of one scratch buffer per dtype and
    device: nothing reads or writes them, only their layout matters.
    """

    __slots__ = ("count", "keeper", "scratch")

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper
        self.count = 0
        self.scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def next(self) -> tuple[bool, Any]:
        index = self.count
        self.count += 1
        if index in self.keeper.kept:
            return True, self.keeper.value(index)
        meta = self.keeper.skip.get(index)
        if meta is None:
            return False, None
        if isinstance(meta, _Shape):
            return True, self._placeholder(meta)
        return True, type(meta)(self._placeholder(m) for m in meta)

    def _placeholder(self, meta: _Shape) -> torch.Tensor:
        """An output nobody reads, with the forward's layout (composite ops such as
        ``matmul`` choose their next ops by it)."""
        key = (meta.dtype, meta.device)
        scratch = self.scratch.get(key)
        if scratch is None:
            size = max(m.elements for m in self.keeper.skip_shapes() if (m.dtype, m.device) == key)
            scratch = self.scratch[key] = torch.empty(size, dtype=meta.dtype, device=meta.device)
        return scratch.as_strided(meta.shape, meta.stride)


class _Shape:
    """What an op output looked like, to stand in for it when it need not be rebuilt."""

    __slots__ = ("device", "dtype", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device

    @property
    def elements(self) -> int:
        """How many elements a storage needs to hold this layout."""
        if 0 in self.shape:
            return 1
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))


def _move(out: Any, device: torch.device) -> Any:
    def move(t: torch.Tensor) -> torch.Tensor:
        pin = t.device.type == "cuda" and device.type == "cpu"
        copy = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
        return copy.copy_(t, non_blocking=pin or device.type == "cuda")

    return _map(out, move)

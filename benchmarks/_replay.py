"""Two reference points for the overhead workload, built on torch's checkpoint: what
dispatch modes cost by themselves, and what a thin verified replay of the matmuls costs.

Neither is a remat mode. Both run `torch.utils.checkpoint` (non-reentrant) with a
dispatch mode in the forward and another in the recompute, as torch's selective
checkpointing does:

- `modes_only`: modes that only run each op (Python's dispatch per op, and nothing else);
- `thin_replay`: the forward keeps the outputs of `SAC_OPS` and records each op with its
  tensor arguments by the op that made them (and their versions); the recompute checks
  each op against that record, raises at the first that differs, and hands back the kept
  outputs instead of running those ops. It checks less than remat does (no keyword
  arguments, random-number states, module state or saved values), so it is a lower bound
  on what verified replay costs, not a replacement for it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ._models import Block

aten = torch.ops.aten
SAC_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _idle_modes() -> tuple[_PassThrough, _PassThrough]:
    return _PassThrough(), _PassThrough()


def modes_only(block: Block) -> Block:
    """torch's checkpoint with pass-through dispatch modes in the forward and the recompute."""
    return functools.partial(checkpoint, block, use_reentrant=False, context_fn=_idle_modes)


class _Record:
    """One region's forward, shared by its two modes: each op, and the kept outputs."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple[Any, ...]]] = []
        self.kept: list[torch.Tensor] = []


class _Thin(TorchDispatchMode):
    """The forward's mode (``recompute=False``) or the recompute's."""

    def __init__(self, record: _Record, recompute: bool) -> None:
        super().__init__()
        self.record, self.recompute = record, recompute
        self.made: dict[int, tuple[weakref.ref[torch.Tensor], int, int, int]] = {}
        self.count = self.used = 0

    def __enter__(self) -> _Thin:
        self.made, self.count, self.used = {}, 0, 0  # (a recompute per backward pass)
        return super().__enter__()  # type: ignore[no-any-return]

    def _keys(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        keys: list[Any] = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                entry = self.made.get(id(arg))
                if entry is not None and entry[0]() is arg:
                    keys.append((entry[1], entry[2], arg._version - entry[3]))
                else:
                    keys.append(id(arg))  # from outside: the same object in both runs
            else:
                keys.append(tuple(arg) if type(arg) is list else arg)
        return tuple(keys)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is aten.detach.default:  # autograd adds and drops these between runs
            return func(*args, **kwargs)
        index, self.count = self.count, self.count + 1
        signature = (func, self._keys(args))
        record = self.record
        if not self.recompute:
            record.ops.append(signature)
            out = func(*args, **kwargs)
            if func in SAC_OPS:
                record.kept.append(out.detach())
        else:
            if index >= len(record.ops) or record.ops[index] != signature:
                raise RuntimeError(f"thin replay: op {index} ({func}) is not the forward's")
            if func in SAC_OPS:
                out, self.used = record.kept[self.used], self.used + 1
            else:
                out = func(*args, **kwargs)
        for position, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = (weakref.ref(t), index, position, t._version)
        return out


def _thin_contexts() -> tuple[_Thin, _Thin]:
    record = _Record()
    return _Thin(record, recompute=False), _Thin(record, recompute=True)


def thin_replay(block: Block) -> Block:
    """torch's checkpoint with a thin verified replay of the matmuls (see the module)."""
    return functools.partial(checkpoint, block, use_reentrant=False, context_fn=_thin_contexts)

"""The op-level view of a region: one dispatch mode for its forward or its recompute.

It sees every aten op the region runs and does, per op, what is switched on:
RNG capture (forward) or replay (recompute), the policy's bookkeeping (forward)
or the verified replay of kept values (recompute), and the `remat.debug` trace.
Ops that remat itself issues from its hooks are marked `QUIET` and pass straight
through, and so do the ops of a region's own recompute started inside its forward
(an ``autograd.grad`` in ``fn``): the forward records only ``fn``'s ops.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode

from . import _torch_private
from ._errors import TraceEntry, describe, source_line
from ._keep import DIVERGED, Keeper
from ._modules import BATCH_NORM_OPS, ModuleState, WriteGuard
from ._provenance import _OPS, Op, op_info, written
from ._replayer import Replayer
from ._rng import RngCapture, RngReplay, threaded

__all__ = ["QUIET", "GuardedOpMode", "LiveReads", "OpMode"]


class _Local(threading.local):
    quiet = 0  # > 0 while remat's own ops run (`QUIET`), per thread


_local = _Local()


class _Quiet:
    """Ops run inside are remat's own: no region records, replays or traces them."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.quiet += 1

    def __exit__(self, *exc: object) -> None:
        _local.quiet -= 1


QUIET = _Quiet()  # one for all: the count lives in the thread


class OpMode(_torch_private.TorchDispatchMode):
    """Sees every aten op of one forward or one recompute.

    It holds no bound method of its own (that cycle left every forward and recompute, with
    their records and tensors, to Python's cyclic collector).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in a dynamo-disable shim that costs
        # more than the mode's own work on every op; remat regions are not compiled.
        return False

    def __init__(
        self,
        *,
        capture: RngCapture | None = None,
        replay: RngReplay | None = None,
        rng: RngCapture | None = None,
        keeper: Keeper | None = None,
        replayer: Replayer | None = None,
        trace: list[TraceEntry] | None = None,
        watch: ModuleState | None = None,
        guard: WriteGuard | None = None,
        second: Callable[[Any, list[Any]], None] | None = None,
    ) -> None:
        super().__init__()
        if not _torch_private.every_op_made() and threaded():
            _torch_private.make_every_op()  # (torch can crash otherwise: see there)
        self.capture, self.replay, self.trace = capture, replay, trace
        self.rng = rng  # a watched forward's, not capturing per op: it notes random ops
        self.keeper, self.replayer = keeper, replayer
        self.watch, self.guard = watch, guard  # the forward's and the recompute's, first calls
        self.reads = guard if guard is not None and guard.live else None  # (checked per op)
        self.checks = watch is not None or guard is not None or trace is not None
        # A per-op policy's recompute with no trace nor private copies read: the replay,
        # and the guard's check of writes (below, unrolled).
        plain = trace is None and watch is None and self.reads is None
        self.replaying = replayer if plain else None
        # A recompute's check of batch norm's writes, where no guard makes it (`SecondUpdates`).
        self.second = second if guard is None else None
        self.paused = 0  # > 0 while the region's own recompute runs inside this forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.paused or _local.quiet:
            return func(*args, **kwargs)
        op = _OPS.get(id(func)) or op_info(func)
        replaying = self.replaying
        if replaying is not None:
            if op.writes and self.guard is not None:
                self._writes(op, args, kwargs)
            return replaying.call(op, args, kwargs, self._run, self._passed)
        keeper = self.keeper
        if not self.checks:  # the usual forward: the bookkeeping alone (below, unrolled)
            if keeper is not None and keeper.program is not None:
                out = keeper.follow(op, args, kwargs, self._run)
                if out is not DIVERGED:
                    return out
            if keeper is not None and op.storage:
                keeper.before(op, args, kwargs)
            if op.writes and self.second is not None and func in BATCH_NORM_OPS:
                self.second(func, written(op, args, kwargs))
            out = self._run(op, args, kwargs)
            if keeper is not None:
                keeper.after(op, args, kwargs, out)
            return out
        if self.reads is not None:
            self.reads.before_read(func, (*args, *kwargs.values()))
        if op.writes and (self.watch is not None or self.guard is not None):
            self._writes(op, args, kwargs)
        if self.replayer is not None:
            out = self.replayer.call(op, args, kwargs, self._run, self._passed)
        elif keeper is not None and keeper.program is not None:
            out = keeper.follow(op, args, kwargs, self._run)
            if out is DIVERGED:
                if op.storage:
                    keeper.before(op, args, kwargs)
                out = self._run(op, args, kwargs)
                keeper.after(op, args, kwargs, out)
        else:
            if keeper is not None and op.storage:
                keeper.before(op, args, kwargs)
            out = self._run(op, args, kwargs)
            if keeper is not None:
                keeper.after(op, args, kwargs, out)
        if self.guard is not None and self.replayer is None:
            self.guard.made(out)
        if self.trace is not None:
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            self.trace.append(TraceEntry(str(func.overloadpacket), describe(first), source_line()))
        return out

    def _writes(self, op: Op, args: Any, kwargs: Any) -> None:
        """The region's op writes in place: the forward's watch, or the recompute's guard.

        (FSDP2's own ops re-gather parameters remat does not pin: see `ModuleState`.)
        """
        func = op.func
        if func.namespace == "fsdp":
            return
        tensors = written(op, args, kwargs)
        if self.watch is not None:
            self.watch.before_write(tensors)
        if self.guard is not None:
            self.guard.before_write(func, tensors)

    def _run(self, op: Op, args: Any, kwargs: Any) -> Any:
        func = op.func
        if not op.random:
            return func(*args, **kwargs)
        if self.capture is not None:
            return self.capture.call(func, args, kwargs)
        if self.replay is not None:
            return self.replay.call(func, args, kwargs)
        if self.watch is not None and self.rng is not None:
            self.rng.saw(func, args, kwargs)
        return func(*args, **kwargs)

    def _passed(self, op: Op, args: Any, kwargs: Any) -> bool:
        """A random op the recompute does not run: whether its draw could be left out."""
        return self.replay is None or self.replay.skip(op.func, args, kwargs)


class GuardedOpMode(OpMode):
    """`OpMode` for a watched forward or a guarded recompute with nothing else to do per op:
    the first calls of a region, which may run compiled code. Dynamo then runs this
    mode's handler as it is, rather than trace into it (torch's default for modes)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    # Its own entry, which torch wraps so that Dynamo does not trace it (`__init_subclass__`).
    __torch_dispatch__ = OpMode.__torch_dispatch__


class LiveReads(TorchFunctionMode):
    """A recompute's torch calls, where it has private copies of tensors the forward read
    and updated (`WriteGuard.live`): a tensor argument showing such memory is given as the
    same view of the copy (`WriteGuard.standing`), wherever the region found it (a set, a
    plain object's attribute), and so is one read outside aten (``.tolist()``,
    ``.numpy()``, ``data_ptr()``), and one through an attribute that views its values
    (``.data``, ``.T``). Other attributes (``.grad``) are the tensor's own. What the call
    returns is handed back as the forward's call would (`WriteGuard.returned`)."""

    def __init__(self, guard: WriteGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name in ("__get__", "__set__") and (
            name == "__set__" or getattr(func.__self__, "__name__", None) not in _VALUE_VIEWS
        ):
            return func(*args, **kwargs)
        with _torch_private.torch_functions_off(), QUIET:
            given = self.guard.standing(args)
            values = tuple(kwargs.values())
            named = self.guard.standing(values) if kwargs else values
        if named is not values:
            kwargs = dict(zip(kwargs, named, strict=True))
        out = func(*given, **kwargs)
        if given is args and named is values:
            return out
        with _torch_private.torch_functions_off(), QUIET:
            return self.guard.returned(out, given, args)


# The tensor attributes that are views of its values.
_VALUE_VIEWS = frozenset(("data", "T", "mT", "H", "mH", "real", "imag"))

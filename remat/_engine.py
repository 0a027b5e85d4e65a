"""The hook engine: one remat region, from forward to every backward pass.

The forward runs ``fn`` under saved-tensor hooks. A saved tensor that is one of
the region's inputs is kept by reference; every other one is packed as a
`_Handle`, so autograd keeps the graph's nodes but none of their activations.
The first unpack in a backward pass re-runs ``fn`` once for that pass and
collects the values of the handles still alive, stopping at the last of them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _functorch, _torch_private
from ._errors import RecomputeError, TraceEntry, debugging, describe, diff_traces, source_line
from ._modules import ModuleState
from ._rng import RngCapture, RngReplay, is_random

__all__ = ["Region"]

_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class _Handle:
    """What autograd holds in place of a value the region will recompute."""

    __slots__ = ("__weakref__", "index")

    def __init__(self, index: int) -> None:
        self.index = index


class _Kept:
    """An input autograd saved, kept by reference with its version.

    Autograd skips its own version check for values packed by hooks.
    """

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version


class _Stop(BaseException):
    """Raised by the recompute's pack hook once every needed value exists."""


def _autocast_state() -> tuple[Any, ...]:
    return tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
    )


@contextlib.contextmanager
def _autocast(state: tuple[Any, ...]) -> Iterator[None]:
    if state == _autocast_state():
        yield
        return
    with contextlib.ExitStack() as stack:
        for device, (enabled, dtype) in zip(_AUTOCAST_DEVICES, state, strict=True):
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.dtype, t.device)


def _producer(t: torch.Tensor) -> str:
    node = t.grad_fn
    if node is None:
        return "a tensor with no autograd history"
    name = node.name()
    return f"the output of {name.removesuffix('Backward0').removesuffix('Backward1')}"


class _OpMode(TorchDispatchMode):
    """Sees every aten op of a forward or recompute: RNG, and the debug trace."""

    def __init__(
        self,
        capture: RngCapture | None,
        replay: RngReplay | None,
        trace: list[TraceEntry] | None,
    ) -> None:
        super().__init__()
        self.capture, self.replay, self.trace = capture, replay, trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if is_random(func):
            if self.capture is not None:
                self.capture.before(args, kwargs)
            if self.replay is not None:
                out = self.replay.call(func, args, kwargs)
                self._record(func, out)
                return out
        out = func(*args, **kwargs)
        self._record(func, out)
        return out

    def _record(self, func: Any, out: Any) -> None:
        if self.trace is not None:
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            self.trace.append(TraceEntry(str(func.overloadpacket), describe(first), source_line()))


class Region:
    """One call of a remat'd function: its forward, and its recomputes."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
        modules: ModuleState | None,
        paths: Callable[[], list[str]],
        preserve_rng: bool,
        check: bool,
    ) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.tensors = inputs
        self.modules = modules
        self.inputs = {id(t): t for t in inputs}
        self.versions = [(t, t._version) for t in inputs]
        self.paths = paths
        self.check = check
        self.handles: list[weakref.ref[_Handle]] = []
        self.meta: list[tuple[Any, ...]] = []
        self.producers: list[str] = []
        self.passes: dict[int, dict[int, torch.Tensor]] = {}
        self.autocast = _autocast_state()
        self.rng = RngCapture() if preserve_rng else None
        self.trace: list[TraceEntry] | None = [] if debugging() else None
        self.levels = _functorch.Levels.capture(inputs)

    def forward(self) -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_torch_private.region_running())
            if self.levels:
                stack.enter_context(_torch_private.saved_tensors_hooks_enabled())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
            if self.rng is not None or self.trace is not None:
                stack.enter_context(_OpMode(self.rng, None, self.trace))
            out = self.fn(*self.args, **self.kwargs)
        if self.levels:
            self.levels.watch_outputs(out)
        return out

    def _is_input(self, t: torch.Tensor) -> bool:
        return self.inputs.get(id(t)) is t

    def _pack(self, t: torch.Tensor) -> Any:
        if self._is_input(t):
            return _Kept(t)
        handle = _Handle(len(self.handles))
        self.handles.append(weakref.ref(handle))
        if self.check:
            self.meta.append(_meta(t))
            self.producers.append(_producer(t))
        return handle

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            if packed.tensor._version != packed.version:
                self._check_inputs()
            return packed.tensor
        key = _torch_private.current_graph_task_id()
        values = self.passes.get(key) if key != -1 else None
        if values is None:
            values = self._recompute()
            if key != -1:
                self.passes[key] = values
                _torch_private.queue_end_of_backward_callback(
                    functools.partial(self._end_pass, key)
                )
        try:
            value = values.pop(packed.index)
        except KeyError:
            raise RuntimeError(
                "`remat`: a saved value was unpacked twice in one backward pass. Read "
                "`ctx.saved_tensors` once per backward, or use `policy='save_everything'`."
            ) from None
        return self.levels.for_backward(value) if self.levels else value

    def _end_pass(self, key: int) -> None:
        self.passes.pop(key, None)

    def _check_inputs(self) -> None:
        for i, (t, version) in enumerate(self.versions):
            if t._version != version:
                raise RuntimeError(
                    f"`remat`: argument {self.paths()[i]} was modified in place between the "
                    f"forward and the backward (version {version} -> {t._version}); its "
                    "gradients would be wrong. Clone it before modifying it, or modify it "
                    "after the backward."
                )

    def _recompute(self) -> dict[int, torch.Tensor]:
        needed = {i for i, ref in enumerate(self.handles) if ref() is not None}
        if not needed:
            return {}
        self._check_inputs()
        last = max(needed)
        values: dict[int, torch.Tensor] = {}
        counter = itertools.count()
        trace: list[TraceEntry] | None = [] if self.trace is not None else None
        replay = self.rng.replay() if self.rng is not None else None
        with contextlib.ExitStack() as stack:
            replant = stack.enter_context(self.levels.restore(self.tensors))
            if self.modules is not None:
                stack.enter_context(self.modules.pinned())
            call: Any = (self.args, self.kwargs)
            inputs = self.inputs
            keep = _torch_private.detach_outermost if self.levels else torch.Tensor.detach
            if replant is not None:
                swap = {id(a): b for a, b in zip(self.tensors, replant.inputs, strict=True)}
                call = optree.tree_map(lambda x: swap.get(id(x), x), call, none_is_leaf=True)
                inputs = {id(t): t for t in replant.inputs}
                keep = replant.keep

            def pack(t: torch.Tensor) -> Any:
                if inputs.get(id(t)) is t:
                    return t
                i = next(counter)
                if self.check:
                    self._compare(i, t, trace)
                if i in needed:
                    values[i] = keep(t)
                if i == last:
                    raise _Stop
                return t

            stack.enter_context(torch.enable_grad())
            stack.enter_context(_torch_private.region_running())
            stack.enter_context(_autocast(self.autocast))
            if self.levels:
                stack.enter_context(_torch_private.saved_tensors_hooks_enabled())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _identity))
            if replay is not None:
                stack.enter_context(replay)
            if replay is not None or trace is not None:
                stack.enter_context(_OpMode(None, replay, trace))
            try:
                self.fn(*call[0], **call[1])
            except _Stop:
                return values
        saved = next(counter)
        what = f" ({self.producers[saved]})" if self.check else ""
        raise RecomputeError(
            f"`remat`: the recompute saved {saved} values for backward but the forward saved "
            f"{len(self.handles)}; value #{saved}{what} was never rebuilt. `fn` must run the "
            "same ops each time it is called." + self._diff(trace)
        )

    def _compare(self, i: int, t: torch.Tensor, trace: list[TraceEntry] | None) -> None:
        if i >= len(self.meta):
            raise RecomputeError(
                f"`remat`: the recompute saved more values than the forward ({len(self.meta)}); "
                f"extra value #{i} is {_producer(t)}, {describe(t)}." + self._diff(trace)
            )
        if _meta(t) != self.meta[i]:
            shape, dtype, device = self.meta[i]
            forward = describe(torch.empty(shape, dtype=dtype, device="meta")).replace(
                "meta", str(device)
            )
            raise RecomputeError(
                f"`remat`: recompute diverged at saved value #{i}. Forward: {self.producers[i]}, "
                f"{forward}. Recompute: {_producer(t)}, {describe(t)}. `fn` must run the same "
                "ops on the same shapes each time; wrap the backward in `remat.debug()` for "
                "both op sequences (the forward must run inside it), or pass "
                "`check='none'` to skip this comparison." + self._diff(trace)
            )

    def _diff(self, trace: list[TraceEntry] | None) -> str:
        if self.trace is None or trace is None:
            return ""
        return "\nOp sequences (forward | recompute):\n" + diff_traces(self.trace, trace)


def _identity(x: Any) -> Any:
    return x

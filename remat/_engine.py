"""The hook engine: one remat region, from its forward to every backward pass.

The forward runs ``fn`` under saved-tensor hooks. Of what autograd saves, the
region's inputs are kept by reference (an inner region hands them to the region
around it instead); everything else is packed as a `_Handle`, so autograd keeps
the graph's nodes but none of those activations. The first unpack of a handle in
a backward pass re-runs ``fn`` once for that pass and collects the values of the
handles still alive, stopping right after the last of them. Under a per-op
policy every op of that re-run is first matched to the forward's, and only a
matched op is replayed from a kept value or skipped (see ``_replayer``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Sequence, Set
from typing import Any, NamedTuple

import optree
import torch

from . import _functorch, _introspect, _torch_private
from ._dispatch import QUIET, GuardedOpMode, LiveReads, OpMode
from ._errors import (
    RecomputeError,
    TraceEntry,
    changed_since_forward,
    data_replaced,
    debugging,
    describe,
    describe_meta,
    diff_traces,
    node_op,
)
from ._keep import Keeper
from ._modules import (
    BATCH_NORM_FUNCTIONS,
    ModuleState,
    SecondUpdates,
    WriteGuard,
    same_storage,
    storage_id,
    storage_of,
)
from ._policies import Policy
from ._replayer import Replayer, Restart, Stop
from ._rng import GeneratorWatch, RngCapture, RngLend, threaded

__all__ = ["Region", "running_region"]

_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
_NOTHING = contextlib.nullcontext()


class _Handle(_torch_private.OpaqueBase):
    """What autograd holds in place of a value the region will recompute.

    An opaque object to torch.compile: compiled autograd's graph passes it to
    ``remat::unpack`` as it is, and only its ``layout`` is read while tracing.
    """

    __slots__ = ("index", "unpack")

    def __init__(self, index: int, unpack: _Unpack) -> None:
        self.index = index
        self.unpack = unpack  # for ``remat::unpack``

    @property
    def layout(self) -> tuple[Any, ...]:
        """Shape, strides, dtype and device of the value (known with ``check="shapes"``)."""
        shape, dtype, device, _, stride = self.unpack.region.meta[self.index]
        return tuple(shape), stride, dtype, device


class _Kept(_torch_private.OpaqueBase):
    """An input autograd saved, by reference; autograd skips version checks for hooks.

    Opaque to torch.compile, as `_Handle` is: ``remat::unpack_kept`` checks its version.
    """

    __slots__ = ("released", "tensor", "unpack", "version")

    def __init__(self, t: torch.Tensor, unpack: _Unpack) -> None:
        self.tensor: torch.Tensor | None = t
        self.version, self.unpack = t._version, unpack
        self.released: tuple[Any, ...] | None = None  # the layout, once released

    @property
    def layout(self) -> tuple[Any, ...]:
        t = self.tensor
        if t is None:
            assert self.released is not None
            return self.released
        return tuple(t.shape), t.stride(), t.dtype, t.device

    def get(self, region: Region) -> torch.Tensor:
        t = self.tensor
        if t is None:
            raise _freed("an input it saved")
        if t._version != self.version:
            region.check_inputs()  # names the argument, while the region holds it
        return _unchanged(t, self.version)

    def release(self) -> None:
        """Let go of the input once a pass that frees the graph has read it."""
        self.released, self.tensor = self.layout, None


class _Weak:
    """A region input, held weakly once a pass that frees the graph has recomputed (its
    storage too: by `storage_id` only)."""

    __slots__ = ("ref", "storage", "version")

    def __init__(self, t: torch.Tensor, version: int, storage: int | None) -> None:
        self.ref, self.version, self.storage = weakref.ref(t), version, storage

    def get(self) -> torch.Tensor:
        t = self.ref()
        if t is None:
            raise _freed("its inputs")
        if not same_storage(t, self.storage):
            raise data_replaced("an argument", "Assign it after the backward.")
        return _unchanged(t, self.version)


def _unchanged(t: torch.Tensor, version: int) -> torch.Tensor:
    if t._version != version:
        fix = "Modify it after the backward."
        raise changed_since_forward("an argument", version, t._version, fix)
    return t


def _freed(what: str) -> RecomputeError:
    return RecomputeError(
        f"`remat`: the region no longer holds {what}: a backward under compiled autograd "
        "freed the graph. Pass `retain_graph=True` to the first backward to run another "
        "through the same graph."
    )


def _frees_graph() -> bool:
    """Whether compiled autograd runs this pass, and frees the graph after it.

    Compiled autograd holds every packed object until its graph returns; the engine
    frees each at its node. So in such a pass remat lets go of the inputs itself, once
    no later unpack of the pass reads them.
    """
    return _torch_private.in_compiled_autograd() and not _torch_private.graph_retained()


class _Outer:
    """An inner region's input, handed to the region around it (as autograd would)."""

    __slots__ = ("packed", "producer", "requires_grad", "unpack")

    def __init__(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any], t: Any) -> None:
        self.packed, self.unpack = pack(t), unpack
        self.requires_grad = t.requires_grad
        # What made it: a recompute gets it back as a leaf (`_RecomputePack._input_again`).
        self.producer = None if t.grad_fn is None else type(t.grad_fn)

    def get(self) -> torch.Tensor:
        """The value, requiring grad as it did in the forward, for a recompute to record."""
        value: torch.Tensor = self.unpack(self.packed)
        # A dead wrapper is re-wrapped (requiring grad) when the recompute re-creates its level.
        needs_grad = self.requires_grad and not value.requires_grad
        if needs_grad and not _torch_private.is_dead_wrapper(value):
            value = _torch_private.requiring_grad(value)
        return value


# A released value, remembered weakly by its memory (alive only while autograd holds it):
# a weak reference to its storage, then its offset, shape, strides and dtype.
_Given = tuple[weakref.ref[Any], Any, torch.Size, tuple[int, ...], torch.dtype]


def _given(t: torch.Tensor) -> _Given | None:
    """None for a value with no storage to remember it by (a sparse tensor): a second
    unpack recomputes it."""
    if t.layout != torch.strided:
        return None
    return weakref.ref(t.untyped_storage()), t.storage_offset(), t.shape, t.stride(), t.dtype


def _given_back(given: _Given) -> torch.Tensor | None:
    storage = given[0]()
    if storage is None:
        return None
    with QUIET:
        empty = torch.empty(0, dtype=given[4], device=storage.device)
        return empty.set_(storage, given[1], given[2], given[3])


class _WrittenError(RuntimeError):
    """A value `fn` modified in place after an op saved it: raised where the backward
    unpacks it, as plain autograd raises (a backward that never unpacks it runs)."""


# One reshape decomposes to any of these, depending on dispatch modes and subclasses.
_RESHAPES = frozenset(
    ["aten.view", "aten._reshape_alias", "aten.reshape_alias", "aten.alias", "aten._unsafe_view"]
)


_CUSTOM = torch.autograd.function.BackwardCFunction


# What a saved value looked like, for ``check="shapes"``: shape, dtype, device, the class
# of the autograd node that made it (None without history), and its strides (compiled
# autograd's graph reads them, `remat::unpack`). A plain tuple: one is made per saved value.
_Meta = tuple[torch.Size, torch.dtype, torch.device, "type | None", tuple[int, ...]]


def _meta(t: torch.Tensor) -> _Meta:
    node = t.grad_fn
    return (t.shape, t.dtype, t.device, None if node is None else type(node), t.stride())


def _same(mine: _Meta, theirs: _Meta, producers: bool) -> bool:
    """Equal metadata, and (if asked) the same producer up to how a reshape decomposed or
    an autograd.Function's presence (FSDP2's post-backward hook runs in the forward only)."""
    if mine[0] != theirs[0] or mine[1] is not theirs[1] or mine[2] != theirs[2]:
        return False
    a, b = mine[3], theirs[3]
    if not producers or a is b or _custom(a) or _custom(b):
        return True
    return a is not None and b is not None and {_producer(a), _producer(b)} <= _RESHAPES


def _custom(node: type | None) -> bool:
    return node is not None and issubclass(node, _CUSTOM)


def _producer(node: type | None) -> str:
    """``aten.addmm`` for ``AddmmBackward0``; "" without history."""
    return "" if node is None else node_op(node.__name__)


def _describe(meta: _Meta) -> str:
    made = f"output of {_producer(meta[3])}" if meta[3] else "a tensor with no autograd history"
    return f"{made}, {describe_meta(meta[0], meta[1], meta[2])}"


class _Running(NamedTuple):
    """An entry of the thread's stack of running forwards and recomputes."""

    region: Region | None  # None for a recompute
    pack: Callable[[torch.Tensor], Any]
    unpack: Callable[[Any], torch.Tensor]
    under_transforms: bool  # its levels are torch.func's: inner regions keep their inputs


def running_region() -> Region | None:
    """The innermost region whose forward is running on this thread."""
    stack = _torch_private.running_regions()
    return stack[-1].region if stack else None


def _autocast_state() -> tuple[Any, ...]:
    return tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
    )


def _autocast(stack: contextlib.ExitStack, state: tuple[Any, ...]) -> None:
    """Enter autocast ``state`` on ``stack`` (nothing, where it is the state already)."""
    if state != _autocast_state():
        for device, (enabled, dtype) in zip(_AUTOCAST_DEVICES, state, strict=True):
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))


def _hooks_added(tensors: list[torch.Tensor]) -> Callable[[], None]:
    """What removes the tensor hooks a recompute registers on ``tensors``, from before it.

    ``fn`` registers them in its forward too (a forward hook that hooks its module's input,
    as attribution libraries do): the recompute's would run a second time.
    """
    count = len(tensors)
    before = list(map(_HOOKS, tensors))  # (native loops: most tensors have no hooks)
    had = (
        {}
        if before.count(_NO_HOOKS) == count
        else {
            i: tuple(hooks and tuple(hooks) for hooks in pair)
            for i, pair in enumerate(before)
            if pair != _NO_HOOKS
        }
    )

    def remove() -> None:
        after = list(map(_HOOKS, tensors))
        if not had and after.count(_NO_HOOKS) == count:
            return
        for i, pair in enumerate(after):
            for now, keys in zip(pair, had.get(i, _NO_HOOKS), strict=True):
                # Unless ``fn`` removed one: it then swaps a hook it holds the handle of
                # (``self.handle.remove()``), and the recompute's stands for the forward's.
                if now and all(key in now for key in keys or ()):
                    for key in [key for key in now if key not in (keys or ())]:
                        del now[key]

    return remove


_HOOKS = operator.attrgetter("_backward_hooks", "_post_accumulate_grad_hooks")
_NO_HOOKS = (None, None)


class _Setting:
    """What a region's recompute re-establishes from its forward, built at the forward.

    The forward's torch.func levels, module state, autocast state, parametrization cache
    (``torch.nn.utils.parametrize.cached()``), the user's torch function modes (autograd
    runs the recompute with none), whether subclasses' ``__torch_function__`` ran, RNG
    capture and per-op bookkeeping; `recreate` enters all of them for one recompute.
    """

    __slots__ = (
        "autocast",
        "cache",
        "function_modes",
        "functions",
        "generators",
        "keeper",
        "levels",
        "modules",
        "owner",
        "rng",
        "threaded",
        "trace",
        "watching",
    )

    def __init__(
        self,
        owner: Any,
        reach: tuple[int, ...],
        inputs: list[torch.Tensor],
        modules: ModuleState | None,
        generators: list[torch.Generator],
        policy: Policy,
        preserve_rng: bool,
        function_modes: Sequence[Any],
    ) -> None:
        self.levels = _functorch.Levels.capture(inputs)
        self.owner, self.modules = owner, modules  # (what learns about the inputs)
        self.autocast = _autocast_state()
        self.cache = _torch_private.parametrization_cache()
        # The user's torch function modes (``torch.device(...)`` is one), not remat's own.
        self.function_modes = [
            mode for mode in function_modes if not type(mode).__module__.startswith("remat.")
        ]
        self.functions = _torch_private.subclass_functions_enabled()
        self.rng = RngCapture() if preserve_rng else None
        self.generators = generators
        collecting = _introspect.current() is not None
        self.keeper = Keeper(policy, inputs, collecting, owner, reach) if policy.per_op else None
        self.trace: list[TraceEntry] | None = [] if debugging() else None
        # Other threads may draw from the shared generators: capture per random op.
        self.threaded = preserve_rng and threaded()
        # The first forward of a module or function in a training mode: see `ModuleState`.
        self.watching = modules is not None and modules.watching

    def per_op(self) -> bool:
        """Whether the forward sees each op to do something with it: a per-op policy,
        `remat.debug`, or other threads alive (random numbers are then captured per op)."""
        return self.keeper is not None or self.trace is not None or self.threaded

    def moded(self, recompute: bool = False) -> bool:
        """Whether the forward (or a recompute now) runs under remat's dispatch mode.

        The forward does if it works per op, or if it is watched (its writes are
        watched, and its recompute's guarded); a recompute also does whenever other
        threads are alive now, as lending RNG states to shared generators is safe only
        while no other thread draws.
        """
        if self.per_op() or self.watching:
            return True
        return recompute and self.rng is not None and threaded()

    def mode_type(self) -> type[OpMode]:
        """`OpMode` where the mode works per op; otherwise (a region's first calls, which
        may run compiled code) `GuardedOpMode`, whose handler Dynamo does not trace."""
        return OpMode if self.per_op() else GuardedOpMode

    def recreate(
        self,
        stack: contextlib.ExitStack,
        region: Region,
        hidden: _torch_private.Hidden,
        make_pack: Callable[
            [list[torch.Tensor], Replayer | None, bool, list[TraceEntry] | None], _RecomputePack
        ],
    ) -> tuple[Any, _RecomputePack]:
        """Enter the forward's setting for one recompute; the call to make, and its pack.
        The modes ``hidden`` holds (the backward's) are shown to the call."""
        leaves, tensors = region.call_now()
        given = leaves  # (the forward's; the recompute's may be copies, `swap`)
        trace: list[TraceEntry] | None = [] if self.trace is not None else None
        stack.enter_context(torch.enable_grad())
        replant = stack.enter_context(self.levels.restore(tensors))
        wrap = functools.partial(self.levels.wrap, replant)
        copies = stack.enter_context(self.modules.pinned(wrap)) if self.modules else []
        in_place = self.modules.in_place() if self.modules else []
        guard = WriteGuard(copies, in_place)
        # With private copies of what the forward updated, the recompute's reads of the
        # memory they stand for are checked, under the mode.
        moded = self.moded(recompute=True) or bool(guard.live)
        swap = {}
        if replant is not None:
            swap = {id(a): b for a, b in zip(tensors, replant.inputs, strict=True)}
        swap.update((id(original), copy) for copy, original, _ in copies)
        if swap:
            tensors = [swap.get(id(t), t) for t in tensors]
            leaves = [swap.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in leaves]
        call = region.build(leaves, swap)
        second = SecondUpdates(self.owner, given, swap, region.paths, self.modules)
        guard.second = second.written
        slots = self.modules.slots if self.modules else ()
        stack.callback(_hooks_added(tensors + [slot.tensor for slot in slots]))
        replayer = Replayer(self.keeper, tensors) if self.keeper is not None else None
        if replayer is not None:
            stack.callback(replayer.close)
            for copy, original, version in copies:
                if id(original) not in region.inputs:
                    replayer.stand_in(copy, original, version)
            for t in in_place:  # (as the forward read it: not as what its ops made of it)
                replayer.stand_in(t, t, t._version)
                replayer.rewound.add(id(t))
            for original, twin in replant.twins if replant is not None else ():
                if twin is not original:
                    replayer.stand_in(twin, original, original._version)
        pack = make_pack(tensors, replayer, replant is None, trace)
        if replayer is not None:
            stack.callback(pack.finish)  # once the dispatch mode below has exited
        running = _Running(None, pack, pack.unpack, under_transforms=False)
        stack.enter_context(_torch_private.region_running(running))
        _autocast(stack, self.autocast)
        if self.cache[0] or _torch_private.parametrization_cache()[0]:
            stack.enter_context(_torch_private.parametrization_cache_set(self.cache))
        if guard.live:  # (below the forward's function modes: they see what its calls saw)
            guard.stand_in = replayer.stand_in if replayer is not None else None
            guard.same = replayer.same if replayer is not None else None
            stack.enter_context(LiveReads(guard))
        if hidden.functions or hidden.dispatch:  # (the backward's)
            stack.enter_context(hidden.shown())
        for function_mode in self.function_modes:
            stack.enter_context(function_mode)
        if _torch_private.subclass_functions_enabled() != self.functions:
            stack.enter_context(_torch_private.subclass_functions(self.functions))
        if self.levels:
            stack.enter_context(_torch_private.saved_tensors_hooks_enabled())
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, pack.unpack))
        replay = None
        if self.rng is not None:
            if moded:
                replay = stack.enter_context(self.rng.replay(per_op=self.per_op()))
            else:
                states = self.rng.lendable()
                stack.enter_context(RngLend(states))
                stack.enter_context(GeneratorWatch(states, BATCH_NORM_FUNCTIONS, second))
        if moded:
            # A per-op policy's recompute runs under the mode anyway: always guarded.
            guard.writes = self.watching or replayer is not None
            guard.made_here = replayer.made_here if replayer is not None else None
            checks = guard if guard.writes or guard.live else None
            mode = self.mode_type()(
                replay=replay, replayer=replayer, trace=trace, guard=checks, second=second.written
            )
            stack.enter_context(mode)
        return call, pack


class Region:
    """One call of a remat'd function: the frame its forward and its recomputes share.

    It holds the call and its inputs, what the forward packed (`_Pack`), and the
    `_Setting` a recompute re-creates; `_Unpack` recomputes on a backward's first
    unpack (`_rerun`, with `_RecomputePack` collecting the values).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        owner: Any,
        reach: tuple[int, ...],
        call: tuple[tuple[Any, ...], dict[str, Any]],
        flat: tuple[list[Any], Any, _Shared | None],
        inputs: list[torch.Tensor],
        modules: ModuleState | None,
        generators: list[torch.Generator],
        policy: Policy,
        preserve_rng: bool,
        check: bool,
        namespace: str,
        hidden: _torch_private.Hidden,
    ) -> None:
        self.fn = fn
        self.hidden = hidden  # the modes ``fn``'s call shows
        self.call: Any = call  # the caller's own arguments, for the forward
        # What the recompute calls ``fn`` with: the call's leaves in its structure as the call
        # began, rebuilt (a list or dict the caller, or ``fn``, changes later is the
        # caller's; one passed twice is one). A tensor leaf may be replaced by a stand-in
        # (`_Outer`, `_Weak`).
        self.leaves, self.structure, self.shared = flat
        self.namespace = namespace
        self.tensors = inputs
        self.inputs = {id(t): t for t in inputs}
        self.versions = [t._version for t in inputs]
        self.storages = list(map(storage_of, inputs))  # (``.data`` assigned: another)
        self.check = check
        self.handles: list[weakref.ref[_Handle]] = []
        self.kinds = bytearray()  # per pack of the forward, in order: handle (1) or not (0)
        self.meta: list[_Meta] = []
        self.saved_inputs: set[int] = set()
        self.setting = _Setting(
            owner, reach, inputs, modules, generators, policy, preserve_rng, hidden.functions
        )
        self.levels, self.keeper = self.setting.levels, self.setting.keeper  # read everywhere
        self.transformed = bool(self.levels)  # under torch.func levels
        self.mode: OpMode | None = None  # the forward's, while it runs
        self.running = False  # whether the forward runs

    def forward(self) -> Any:
        try:
            return self._forward()
        except BaseException:
            # An error in ``fn`` or at its end (a `Stop` from the region around, a kept
            # placeholder there): the values kept so far have histories that hold this
            # region through autograd's hooks, a cycle no collector sees.
            if self.keeper is not None:
                self.keeper.kept.clear()
            raise

    def _forward(self) -> Any:
        # The hooks are not kept on the region: autograd's saved values own them.
        unpack = _Unpack(self)
        pack = _Pack(self, unpack)
        running = _torch_private.region_running(
            _Running(self, pack, unpack.fetch, bool(self.levels))
        )
        enabled = _torch_private.saved_tensors_hooks_enabled() if self.levels else _NOTHING
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        setting = self.setting
        moded = setting.moded()
        if moded:
            watch = setting.modules if setting.watching else None
            capture = setting.rng if setting.per_op() else None
            noted = setting.rng if capture is None and watch is not None else None
            if noted is not None:
                noted.ops = []
            self.mode = setting.mode_type()(
                capture=capture, rng=noted, keeper=self.keeper, trace=setting.trace, watch=watch
            )
        rng = None if setting.per_op() else setting.rng  # not per op: read generators around
        if rng is not None:
            rng.start(setting.generators)
        closures = self.levels.watch_closures(self.tensors)
        self.running = True
        with running:
            with self.hidden.shown(), enabled, hooks, self.mode or _NOTHING, closures:
                try:
                    out = self.fn(*self.call[0], **self.call[1])
                finally:
                    self.running = False
            self.mode = None
            if rng is not None:
                rng.finish()
            self.check_inputs(inside=True)
            if setting.modules is not None:
                setting.modules.settle()
            outer = self.enclosing()
            self.call = None  # (the caller's: not held)
            if outer is not None:
                self._hand_over_inputs(outer)
        if self.keeper is not None:
            recorded = bool(self.levels) and self.levels.records_recompute(
                self.tensors + self.keeper.outside_tensors()
            )
            leaves = optree.tree_leaves(out, none_is_leaf=True, namespace=self.namespace)
            outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
            self.keeper.finish(outputs, skip=not recorded)
        if self.levels:
            self.levels.watch_outputs(out)
        found = _introspect.current()
        if found is not None:
            self._report(found)
        return out

    def _hand_over_inputs(self, outer: _Running) -> None:
        """Inside another region, hold no input: the outer region saves them for us."""
        pack, unpack = outer.pack, outer.unpack
        slots = {id(t): _Outer(pack, unpack, t) for t in self.tensors}
        self.leaves = _replaced(self.leaves, slots)
        self.tensors, self.inputs, self.versions, self.storages = [], {}, [], []

    def hold_inputs_weakly(self) -> None:
        """After this pass's recompute: hold the inputs only while something else does."""
        held = zip(self.tensors, self.versions, self.storages, strict=True)
        slots = {id(t): _Weak(t, v, storage_id(storage)) for t, v, storage in held}
        self.leaves = _replaced(self.leaves, slots)
        self.tensors, self.inputs, self.versions, self.storages = [], {}, [], []

    def call_now(self) -> tuple[list[Any], list[torch.Tensor]]:
        """The leaves of the call a recompute makes, and its tensor inputs, fetched back if
        handed over or held weakly."""
        leaves, tensors = self.leaves, self.tensors
        if not tensors and self.inputs_handed_over():
            fetched: dict[int, torch.Tensor] = {}

            def fetch(x: Any) -> Any:
                if not isinstance(x, (_Outer, _Weak)):
                    return x
                if id(x) not in fetched:  # one tensor passed twice is handed over once
                    fetched[id(x)] = x.get()
                return fetched[id(x)]

            leaves = list(map(fetch, leaves))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        return leaves, tensors

    def build(self, leaves: list[Any], swap: dict[int, Any] | None = None) -> Any:
        """The call rebuilt from ``leaves``: new containers, one per container of the call
        (but those passed as themselves, `_Shared`). ``swap``: the recompute's tensors, by
        the id of the forward's they stand for."""
        if self.shared is not None:
            return self.shared.build(leaves, swap or {})
        return optree.tree_unflatten(self.structure, leaves)

    def inputs_handed_over(self) -> bool:
        return any(isinstance(x, (_Outer, _Weak)) for x in self.leaves)

    def paths(self) -> list[str]:
        call = optree.tree_unflatten(self.structure, self.leaves)
        return _introspect.input_paths(self.fn, call, (torch.Tensor, _Outer), self.namespace)

    def _report(self, found: _introspect.Collector) -> None:
        """Tell `saved_residuals` what this region holds after its forward."""
        paths = self.paths()
        for i, t in enumerate(self.tensors):
            if id(t) in self.saved_inputs:
                found.add_saved(t, paths[i])
        if self.keeper is None:
            return
        keeper = self.keeper
        for index, (out, _) in keeper.kept.items():
            op = keeper.ops[index]
            kind = "offloaded" if index in keeper.offload else "saved"
            name = ", ".join(sorted(keeper.tags.get(index, ()))) or None
            where = f"output of {op.overloadpacket} at {(keeper.sources or {}).get(index, '?')}"
            where += keeper.reason(index)
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    found.add(t, kind, op, name, where)

    def enclosing(self) -> _Running | None:
        """The forward or recompute running around this region's forward, at its levels.

        Under torch.func transforms the inner region keeps its inputs: autograd may
        save at another level than the outer region's, and batched values do not
        survive the hand-over.
        """
        if self.levels:
            return None
        running = _torch_private.running_regions()
        for i in range(len(running) - 1, 0, -1):
            if running[i].region is self:
                outer = running[i - 1]
                return None if outer.under_transforms else outer
        return None

    def check_inputs(self, inside: bool = False) -> None:
        for i, (t, storage) in enumerate(zip(self.tensors, self.storages, strict=True)):
            if not same_storage(t, storage_id(storage)):
                raise data_replaced(
                    f"argument {self.paths()[i]}",
                    "Assign `.data` after the backward, or pass another tensor to the next call.",
                )
        for i, (t, version) in enumerate(zip(self.tensors, self.versions, strict=True)):
            if t._version == version:
                continue
            if inside:
                by = f" by {node_op(t.grad_fn)}" if t.grad_fn is not None else ""
                raise RecomputeError(
                    f"`remat`: argument {self.paths()[i]} was modified in place inside `fn`"
                    f"{by} (version {version} -> {t._version}); the recompute would read the "
                    "modified value and modify it again. Clone it inside `fn` before modifying "
                    "it (`x = x.clone()`), or modify it outside the remat'd function."
                )
            raise changed_since_forward(
                f"argument {self.paths()[i]}",
                version,
                t._version,
                "Clone it before modifying it, or modify it after the backward.",
            )


class _Pack:
    """The forward's pack hook: an input by reference, any other value as a `_Handle`."""

    __slots__ = ("region", "unpack")

    def __init__(self, region: Region, unpack: _Unpack) -> None:
        self.region, self.unpack = region, unpack

    def __call__(self, t: torch.Tensor) -> Any:
        region = self.region
        if region.inputs.get(id(t)) is t:
            region.kinds.append(0)
            outer = region.enclosing()
            if outer is not None:
                return _Outer(outer.pack, outer.unpack, t)
            region.saved_inputs.add(id(t))
            return _Kept(t, self.unpack)
        handle = _Handle(len(region.handles), self.unpack)
        if region.keeper is not None:
            region.keeper.note_saved(t)
        region.kinds.append(1)
        region.handles.append(weakref.ref(handle))
        if region.check:
            region.meta.append(_meta(t))
        return handle


class _Unpack:
    """The backward's unpack hook: the value behind what `_Pack` returned.

    The first unpack of a handle in a backward pass recomputes every handle still
    alive; the values wait, per pass, for their own unpack.
    """

    __slots__ = ("__weakref__", "dispatch_keys", "given", "passes", "region")

    def __init__(self, region: Region) -> None:
        self.region = region
        self.passes: dict[int, dict[int, torch.Tensor]] = {}  # graph task -> handle -> value
        self.given: dict[int, dict[int, _Given]] = {}  # graph task -> handle -> released value
        self.dispatch_keys = _torch_private.dispatch_keys()  # the forward's

    def __call__(self, packed: Any) -> torch.Tensor:
        if _torch_private.in_compiled_autograd():
            # Compiled autograd traces the hooks with Dynamo. Handles and kept inputs go
            # into its graph as opaque ops; anything else (an outer region's input, a
            # handle without recorded shapes) runs outside the graph, a graph break.
            if torch.compiler.is_compiling():
                if isinstance(packed, _Handle) and self.region.check:
                    return torch.ops.remat.unpack(packed)
                if isinstance(packed, _Kept):
                    return torch.ops.remat.unpack_kept(packed)
            value = _UNTRACED_UNPACK(self, packed)
            if isinstance(packed, _Kept) and _frees_graph():
                packed.release()
            return value
        region = self.region
        if type(packed) is _Handle and not region.transformed and region.mode is None:
            return self._handle(packed, release=True)  # eager, outside torch.func: the usual
        return self.unpack(packed)

    def unpack(self, packed: Any) -> torch.Tensor:
        """`fetch`, then what functorch's own pass should see."""
        region = self.region
        value = self.fetch(packed)
        if region.transformed and type(packed) is not _Outer:
            with QUIET:
                value = region.levels.for_backward(value)
        if region.keeper is not None and region.mode is not None and type(packed) is _Handle:
            region.keeper.handed_back(packed.index, value)  # inside our own forward
        return value

    def fetch(self, packed: Any) -> torch.Tensor:
        """The value behind ``packed`` (recomputing the region if needed)."""
        kind = type(packed)  # not isinstance: the opaque types' metaclass makes it slow
        if kind is _Kept:
            return packed.get(self.region)
        if kind is _Outer:
            return packed.get()
        # (A compiled graph may reuse the memory of what it unpacked.)
        release = not self.region.transformed and not _torch_private.in_compiled_autograd()
        return self._handle(packed, release)

    def _handle(self, packed: _Handle, release: bool) -> torch.Tensor:
        """A handle's value, recomputed for this pass at its first unpack; ``release``: and
        remembered only weakly once given (see `_again`)."""
        key = _torch_private.current_graph_task_id()
        values = self.passes.get(key) if key != -1 else None
        if values is None:
            values = self.recompute()
            region = self.region
            if not (region.transformed or region.keeper is not None or region.running) and (
                _frees_graph()
            ):
                region.hold_inputs_weakly()
            if key != -1:
                self.passes[key] = values
                # Weakly: a region whose nodes have all run must not outlive them.
                _torch_private.queue_end_of_backward_callback(
                    functools.partial(_end_pass, weakref.ref(self), key)
                )
        value: Any = values.pop(packed.index, None)  # (or a `_WrittenError`)
        if value is None:
            value = self._again(packed, key)
        elif type(value) is _WrittenError:
            raise value
        elif release and key != -1:
            given = _given(value)
            if given is not None:
                self.given.setdefault(key, {})[packed.index] = given
        return value

    def _again(self, packed: _Handle, key: int) -> torch.Tensor:
        """A value unpacked twice in one pass (in-place ops on views can do this).

        Values are released at their first unpack: a second one gets the same
        memory back while autograd still holds it, or else is recomputed alone.
        """
        given = self.given.get(key, {}).get(packed.index)
        value: Any = _given_back(given) if given is not None else None
        if value is None:
            value = self.recompute(only=packed.index)[packed.index]
            if type(value) is _WrittenError:
                raise value
        return value

    def recompute(self, only: int | None = None) -> dict[int, torch.Tensor]:
        region = self.region
        if only is None:
            alive = map(weakref.ref.__call__, region.handles)  # (native loops: they are many)
            needed = set(itertools.compress(itertools.count(), alive))
        else:
            needed = {only}
        if not needed:
            return {}
        region.check_inputs(inside=region.running)
        if region.keeper is not None and _torch_private.in_compiled_autograd():
            raise RecomputeError(
                f"`remat`: the policy {region.keeper.policy!r} replays kept values op "
                "by op, which remat does not support under compiled autograd yet. Use the "
                "default policy there (`save_nothing`), or compile the model itself "
                "(`torch.compile`), where every policy that decides by op works."
            )
        forward = region.mode  # set while the forward runs: an ``autograd.grad`` inside ``fn``
        if forward is not None:
            forward.paused += 1
        try:
            try:
                values = _rerun(region, needed)
            except Restart:
                # A value the recompute skipped was read (outside aten, or by an op that did
                # not match the forward's): run again, skipping nothing.
                assert region.keeper is not None
                region.keeper.stop_skipping()
                values = _rerun(region, needed)
        finally:
            if forward is not None:
                forward.paused -= 1
        if only is None and region.keeper is not None:
            region.keeper.release()
        return values


_UNTRACED_UNPACK = _torch_private.dynamo_disabled(_Unpack.unpack)

_torch_private.register_opaque(_Handle, lambda handle: [handle.layout], read=("layout",))


_torch_private.register_opaque(_Kept, lambda kept: [kept.layout], read=("layout",))


def _unpack_in_graph(packed: _Handle | _Kept) -> torch.Tensor:
    """The value behind ``packed``, inside compiled autograd's compiled graph.

    The ops run below autograd; a recompute needs it, under the forward's dispatch
    keys. They return a copy: the compiler owns what an op returns and reuses its
    memory, and an unpacked value may share memory with another one (a view, the
    same tensor saved twice) or be a parameter. (inductor gave wrong gradients
    without the copy.) A kept input's version is checked, as in eager mode.
    """
    unpack = packed.unpack
    with _torch_private.dispatch_keys_set(unpack.dispatch_keys), torch.enable_grad():
        value = unpack.unpack(packed)
    copy = _unpacked_like(packed).copy_(value)  # the forward's strides, traced with
    if isinstance(packed, _Kept) and _frees_graph():
        packed.release()
    return copy


def _unpacked_like(packed: _Handle | _Kept) -> torch.Tensor:
    shape, stride, dtype, device = packed.layout
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


# One op per opaque type (an op's schema names one).
for _name, _type in (("remat::unpack", _Handle), ("remat::unpack_kept", _Kept)):
    torch.library.custom_op(
        _name,
        _unpack_in_graph,
        mutates_args=(),
        schema=f"({_type.__module__}.{_type.__qualname__} packed) -> Tensor",
    ).register_fake(_unpacked_like)


def flatten_call(call: Any, namespace: str) -> tuple[list[Any], Any, list[Any]]:
    """The call's leaves and tree structure, and what the flatten met that is not a tensor
    or a number, in order (for `call_plan`)."""
    # Held until the plan is made: a container's flatten may make new ones, and one freed
    # may lend its id to the next.
    nodes: list[Any] = []

    def note(node: Any) -> bool:
        if not isinstance(node, _ATOMS):  # (a tensor passed twice is one leaf twice)
            nodes.append(node)
        return False

    leaves, structure = optree.tree_flatten(call, note, none_is_leaf=True, namespace=namespace)
    return leaves, structure, nodes


def call_plan(
    call: Any, leaves: list[Any], nodes: list[Any], namespace: str, restored: Set[int]
) -> _Shared | None:
    """A `_Shared` if one container is in the call twice, if one is among ``restored``
    (ids: containers whose contents the recompute shows as the forward began, in place,
    `ModuleState.pinned`: the recompute passes those as themselves), or if an
    ``OrderedDict`` is in another order than its keys were first in (``move_to_end``):
    `optree.tree_unflatten` rebuilds that one in its first order.

    None where the walk meets the leaves in another order than the flatten (no case is
    known): then the call is rebuilt as flattened."""
    if (
        _repeated(nodes, namespace)
        or (restored and any(id(n) in restored for n in nodes))
        or any(map(_reordered, nodes))
    ):
        shared = _Shared(call, namespace, restored)
        if len(shared.walked) == len(leaves) and all(map(operator.is_, shared.walked, leaves)):
            shared.walked = []
            return shared
    return None


def _reordered(node: Any) -> bool:
    """An ``OrderedDict`` whose order is not its keys' first (which optree flattens in)."""
    return type(node) is collections.OrderedDict and list(node) != list(dict.__iter__(node))


def _repeated(nodes: list[Any], namespace: str) -> bool:
    """Whether a container is among ``nodes`` twice (an object optree does not walk, such as
    a module, is itself in the recompute anyway)."""
    if len(set(map(id, nodes))) == len(nodes):
        return False  # (the usual)
    seen: set[int] = set()
    for node in nodes:
        if id(node) in seen and not optree.tree_is_leaf(
            node, none_is_leaf=True, namespace=namespace
        ):
            return True
        seen.add(id(node))
    return False


_ATOMS = (torch.Tensor, int, float, str, type(None))


class _Shared:
    """Rebuilds a call from its leaves with its containers' identities and orders: a list
    passed twice is one list, as in the forward (`optree.tree_unflatten` would make two);
    a module's list or dict (``restored``) is itself, where it holds what the forward
    read."""

    def __init__(self, call: Any, namespace: str, restored: Set[int] = frozenset()) -> None:
        self.namespace = namespace
        self.held: list[Any] = []  # what the walk met (a flatten may make new containers)
        self.walked: list[Any] = []  # the leaves, in the walk's order: the flatten's
        self.plans: dict[int, Any] = {}  # each container's plan, by key
        # The restored containers met, by key, and each dict's keys in their order.
        self.restored = restored
        self.objects: dict[int, Any] = {}
        self.orders: dict[int, list[Any]] = {}
        self.plan = self._walk(call, {})
        self.held = []

    def _walk(self, node: Any, seen: dict[int, int]) -> Any:
        """A leaf's index; ``(key,)`` for a container seen before; or ``(key, unflatten,
        metadata, children)``, the children in the container's order, walked in the
        flatten's."""
        self.held.append(node)  # (its id is its own while the walk runs)
        ns = self.namespace
        if optree.tree_is_leaf(node, none_is_leaf=True, namespace=ns):
            self.walked.append(node)
            return len(self.walked) - 1
        if id(node) in seen:  # its leaves are in the flat list again: skip them
            self.walked += optree.tree_leaves(node, none_is_leaf=True, namespace=ns)
            return (seen[id(node)],)
        key = seen[id(node)] = len(seen)
        if id(node) in self.restored:
            self.objects[key] = node
            if isinstance(node, dict):
                self.orders[key] = list(node)
        children, metadata, entries, unflatten = optree.tree_flatten_one_level(
            node, none_is_leaf=True, namespace=ns
        )
        order: Any = range(len(children))
        if _reordered(node):  # flattened in its keys' first order
            position = {entry: i for i, entry in enumerate(entries)}
            order = [position[entry] for entry in dict.__iter__(node)]
        plans: list[Any] = [None] * len(children)
        for i in order:
            plans[i] = self._walk(children[i], seen)
        plan = self.plans[key] = (key, unflatten, metadata, plans)
        return plan

    def build(self, leaves: list[Any], swap: dict[int, Any]) -> Any:
        made: dict[int, Any] = {}

        def make(plan: Any) -> Any:
            if isinstance(plan, int):
                return leaves[plan]
            key = plan[0]
            if key in made:  # (met before, or in the container's order first: walked later)
                return made[key]
            key, unflatten, metadata, children = self.plans[key]
            node = self.objects.get(key)
            if node is not None:
                trial = dict(made)  # (kept only if it holds)
                puts: list[tuple[Any, Any, Any]] = []
                if self._holds(plan, node, leaves, trial, swap, puts):
                    for holder, entry, value in puts:
                        holder[entry] = value  # (`ModuleState.pinned` puts it back)
                    made.update(trial)
                    return node
            made[key] = node = unflatten(metadata, [make(child) for child in children])
            return node

        return make(self.plan)

    def _holds(
        self,
        plan: Any,
        node: Any,
        leaves: list[Any],
        made: dict[int, Any],
        swap: dict[int, Any],
        puts: list[tuple[Any, Any, Any]],
    ) -> bool:
        """Whether ``node`` holds, as the recompute begins, what the forward read there: the
        same leaves (by identity; a tensor the recompute swaps for its own, in ``puts``, to
        be put in its place), in the same containers, order and structure, each a restored
        container or a tuple. Notes them in ``made``."""
        key, _, metadata, children = self.plans[plan[0]]
        if key in made:
            return made[key] is node
        expected = self.objects.get(key)
        if (node is not expected) if expected is not None else (type(node) is not tuple):
            return False
        now, now_metadata, entries, _ = optree.tree_flatten_one_level(
            node, none_is_leaf=True, namespace=self.namespace
        )
        if len(now) != len(children) or now_metadata != metadata:
            return False
        if key in self.orders and list(node) != self.orders[key]:
            return False
        for child, value, entry in zip(children, now, entries, strict=True):
            if not isinstance(child, int):
                if not self._holds(child, value, leaves, made, swap, puts):
                    return False
            elif value is not leaves[child]:
                if expected is None or swap.get(id(value)) is not leaves[child]:
                    return False
                puts.append((node, entry, leaves[child]))  # (not in a tuple)
        made[key] = node
        return True


def _replaced(leaves: list[Any], slots: dict[int, Any]) -> list[Any]:
    """The tensors among ``leaves`` replaced by their stand-ins in ``slots``, by identity."""
    return [slots.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in leaves]


def _end_pass(unpack: weakref.ref[_Unpack], key: int) -> None:
    alive = unpack()
    if alive is not None:
        alive.passes.pop(key, None)
        alive.given.pop(key, None)


def _rerun(region: Region, needed: set[int]) -> dict[int, torch.Tensor]:
    """Run ``fn`` again at the forward's levels and state, up to the last needed value."""
    with _torch_private.Hidden() as hidden, contextlib.ExitStack() as stack:
        call, pack = region.setting.recreate(
            stack, region, hidden, functools.partial(_RecomputePack, region, needed)
        )
        replayer = pack.replayer
        try:
            region.fn(*call[0], **call[1])
        except Stop:
            pass
        except Exception as error:
            if replayer is not None and replayer.placeholders:  # ``.numpy()`` on one, say
                raise Restart from error
            raise
        if replayer is not None and replayer.restart:  # ``fn`` caught `Restart`
            raise Restart
        stopped = pack.stopped or not pack.remaining
        skipped = replayer is not None and bool(replayer.placeholders)
    pack.check_versions()  # (outside the recompute's modes, which would see each read)
    if stopped:
        return pack.values  # (detached as the recompute ended: `_RecomputePack.finish`)
    if skipped:  # ``fn`` may have read a skipped value where no op shows (its ``.device``)
        raise Restart
    missing = min(needed - pack.values.keys())
    raise RecomputeError(
        f"`remat`: the recompute rebuilt {len(pack.values)} of the {len(needed)} values "
        f"backward needs; value #{missing}"
        + (f" ({_describe(region.meta[missing])})" if region.check else "")
        + " was never rebuilt. `fn` must run the same ops each time it is called."
        + pack.diff()
    )


_VERSION = operator.attrgetter("_version")
_SAVED, _SAVED_VERSION = operator.itemgetter(1), operator.itemgetter(2)


class _RecomputePack:
    """The recompute's pack hook: collects the needed values, stops after the last one.

    Without a dispatch mode the forward's packs are followed in order; with one,
    each saved value is matched to the forward's by where it came from.
    """

    def __init__(
        self,
        region: Region,
        needed: set[int],
        inputs: list[torch.Tensor],
        replayer: Replayer | None,
        producers: bool,
        trace: list[TraceEntry] | None,
    ) -> None:
        self.region, self.trace, self.replayer = region, trace, replayer
        self.inputs = inputs  # the recompute's, as ``fn`` gets them
        self.needed, self.remaining = needed, len(needed)
        self.producers = producers and replayer is None
        self.values: dict[int, Any] = {}
        # Each value's tensor and version as it was saved, until the recompute ends.
        self.versions: list[tuple[int, torch.Tensor, int]] = []
        self.kinds = iter(region.kinds)
        self.count = 0
        self.stopped = False
        # The node of the op that saved the last value with no history, and, once every
        # value is in, of the op that saved it, if it saved the last value too.
        self.unwritten: int | None = None
        self.after: int | None = None
        self.check = region.meta if region.check else None  # the forward's `_meta`s
        # Under re-created levels, a value wrapped at one dies with it and then acts
        # as its contents, as the forward's own (dead) wrapper does. A per-op policy's
        # recompute runs under remat's dispatch mode: its values wait (`_Matched`).
        self.keep: Callable[[torch.Tensor], torch.Tensor] = (
            _torch_private.detach_outermost if region.levels else torch.Tensor.detach
        )
        self.matched: list[_Matched] | None = (
            [] if replayer is not None and not region.levels else None
        )

    def __call__(self, t: torch.Tensor) -> Any:
        if self.stopped:  # ``fn`` caught `Stop` and went on
            raise Stop
        if self.after is not None:  # every value is in; the op that saved the last one ran?
            node = t.grad_fn
            if node is None or node._sequence_nr() < self.after:
                return t
            self.stopped = True
            raise Stop
        if _torch_private.dispatch_modes():  # (its ops are remat's own: no mode may see them)
            with QUIET:
                return self._collect(t)
        return self._collect(t)

    def _collect(self, t: torch.Tensor) -> Any:
        """The value ``t`` stands for, if it is one the backward needs."""
        if self.replayer is not None:
            index = self.replayer.handle(t)
        elif next(self.kinds, 1):
            index, self.count = self.count, self.count + 1
        else:
            index = None
        if index is None:
            return t
        if self.check is not None:
            forward = self.check[index] if index < len(self.check) else None
            node = t.grad_fn
            if (
                forward is None
                or t.shape != forward[0]
                or t.dtype is not forward[1]
                or t.device != forward[2]
                or (None if node is None else type(node)) is not forward[3]
            ):
                self._compare(index, t)  # raises, unless the producers only look different
        value: Any
        if self.matched is not None:
            assert self.replayer is not None
            value = _Matched(t, self.replayer)
            self.matched.append(value)
        else:
            value = self.keep(t)
            if self.replayer is not None:
                self.replayer.handed_back(value)
        if index in self.needed and index not in self.values:
            self.values[index] = value
            self.versions.append((index, t, t._version))
            self.remaining -= 1
            if t.grad_fn is None and not t.requires_grad:
                # A value with no history may be an argument that the op saving it writes
                # after saving it, with no version bump (rrelu's noise).
                self.unwritten = _torch_private.last_node()
        if not self.remaining:
            if self.unwritten is not None and self.unwritten == _torch_private.last_node():
                # That op saved the last value too: stop once it has run, at a value of its
                # node or a later one (or at the end of ``fn``).
                self.after = self.unwritten
                if self.replayer is not None:  # (it sees that op run, and stops then)
                    self.replayer.stop_after = self.unwritten
                return value
            self.stopped = True
            raise Stop
        return value

    def check_versions(self) -> None:
        """Each value ``fn`` modified in place after an op saved it (the recompute ran on
        past the write, which the value now shows) becomes a `_WrittenError`, which its unpack
        raises, as plain autograd's does."""
        versions, self.versions = self.versions, []  # (they hold the recompute's graph)
        if list(map(_VERSION, map(_SAVED, versions))) == list(map(_SAVED_VERSION, versions)):
            return  # (the usual, in native loops)
        for index, t, version in versions:
            if t._version != version:
                self.values[index] = _WrittenError(
                    "`remat`: one of the values saved for the backward was modified by an "
                    f"inplace operation inside `fn` after it was saved (value #{index}, "
                    f"{describe(t)}, version {version} -> {t._version}). Plain autograd "
                    "raises here too. Compute the modified value out of place."
                )

    def unpack(self, packed: Any) -> Any:
        """The recompute's unpack hook (``fn`` may run a backward inside)."""
        return packed.get() if type(packed) is _Matched else packed

    def finish(self) -> None:
        """End of the recompute, its dispatch mode exited: each waiting value detached, and
        the recompute's graph let go (a value it saved held it)."""
        if not self.matched:
            return
        with QUIET:  # remat's own ops; a plain tensor's pass below every dispatch mode
            with torch._C._DisableTorchDispatch():
                for matched in self.matched:
                    if type(matched.tensor) is torch.Tensor:
                        matched.finish()
            for matched in self.matched:
                matched.finish()  # the rest: a subclass's own dispatch runs
        self.values = {i: v.get() for i, v in self.values.items()}
        self.matched = None

    def _compare(self, i: int, t: torch.Tensor) -> None:
        """Raise if the recompute's value #i does not look like the forward's."""
        # Inputs re-wrapped at re-created levels have no history there: skip producers.
        forward = self.region.meta
        meta = _meta(t)
        if i >= len(forward):
            raise RecomputeError(
                f"`remat`: the recompute saved more values than the forward ({len(forward)}); "
                f"the extra one is {_describe(meta)}. `fn` must run the same ops each time it "
                "is called." + self.diff()
            )
        if not _same(meta, forward[i], self.producers) and not self._input_again(t, forward[i]):
            raise RecomputeError(
                f"`remat`: the recompute diverged from the forward at saved value #{i}. "
                f"Forward: {_describe(forward[i])}. Recompute: {_describe(meta)}. `fn` must run "
                "the same ops on the same shapes each time it is called. Run the forward inside "
                "`remat.debug()` to see both op sequences, or pass `check='none'` to skip "
                "this comparison." + self.diff()
            )

    def _input_again(self, t: torch.Tensor, forward: _Meta) -> bool:
        """Whether ``t`` is an input the region around handed over (a leaf here), that
        autograd unpacked inside ``fn`` (an ``autograd.grad``) and that something saved
        again: the forward's had the input's producer then."""
        if t.grad_fn is not None or not _same(_meta(t), forward, False):
            return False
        leaves = self.region.leaves
        originals = [x for x in leaves if isinstance(x, (torch.Tensor, _Outer, _Weak))]
        for original, given in zip(originals, self.inputs, strict=True):
            if (
                type(original) is _Outer
                and original.producer is forward[3]
                and t.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
                and t.storage_offset() == given.storage_offset()
                and t.stride() == given.stride()
            ):
                return True
        return False

    def diff(self) -> str:
        """Both op sequences, under `remat.debug`."""
        forward = self.region.setting.trace
        if forward is None or self.trace is None:
            return ""
        return "\nOp sequences (forward | recompute):\n" + diff_traces(forward, self.trace)


class _Matched:
    """A value a per-op policy's recompute saved and matched to the forward's, as the
    recompute's autograd holds it.

    Detaching it inside the recompute's dispatch mode costs a guard per value; so it waits,
    and is detached when the recompute ends (`_RecomputePack.finish`), or when the
    recompute itself unpacks it: it then stands for the value it rebuilds (`Replayer`),
    for the ops that read it.
    """

    __slots__ = ("replayer", "signature", "tensor", "value")

    def __init__(self, t: torch.Tensor, replayer: Replayer) -> None:
        self.tensor: torch.Tensor | None = t
        self.replayer, self.signature = replayer, replayer.last
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.value is None:
            assert self.tensor is not None
            with QUIET:
                self.value = self.tensor.detach()
            self.replayer.handed_back(self.value, self.signature)
        return self.value

    def finish(self) -> None:
        if self.value is None:
            assert self.tensor is not None
            self.value = self.tensor.detach()
        self.tensor = None


def _identity(x: Any) -> Any:
    return x

"""Every private torch API that remat uses, and nothing else.

Each entry says why no public API serves. ``tests/test_torch_private.py`` checks
each one against the installed torch, so an upgrade that changes them fails loudly.
Differences between the supported torch releases (docs/versions.md) are absorbed
here too, by feature detection (the newer name first), never by version numbers.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import thread as futures_thread
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.forward_ad as fwAD
from torch._functorch import pyfunctorch
from torch.nn.utils import parametrize as _parametrize
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._python_dispatch import is_traceable_wrapper_subclass as is_wrapper_subclass

_F: Any = torch._C._functorch

# The base of the classes passed to custom ops by reference (see `register_opaque`).
if TYPE_CHECKING:
    from torch._opaque_base import OpaqueBase
else:
    try:  # torch 2.14's name (importing torch._opaque_base then logs a deprecation)
        from torch._custom_class_base import CustomClassBase as OpaqueBase
    except ImportError:
        from torch._opaque_base import OpaqueBase

__all__ = [
    "current_graph_task_id",
    "last_node",
    "dispatch_modes",
    "graph_retained",
    "functorch_cleared",
    "functorch_interpreters",
    "generator_identity",
    "inductor_thread",
    "is_dead_wrapper",
    "level_witness",
    "levels_popped",
    "new_grad_level",
    "new_vmap_level",
    "new_jvp_level",
    "tangents",
    "parametrization_cache",
    "parametrization_cache_set",
    "dead_twin",
    "detach_outermost",
    "in_grad_transform_backward",
    "top_grad_level",
    "add_batch_dim",
    "unwrap",
    "unwrap_all",
    "wrapper_chain",
    "wrapper_level",
    "wrap_for_grad",
    "queue_end_of_backward_callback",
    "in_compiled_autograd",
    "inside_compiled_call",
    "dispatch_keys",
    "dispatch_keys_set",
    "register_opaque",
    "OpaqueBase",
    "traced_under_functorch",
    "dynamo_disabled",
    "region_running",
    "running_regions",
    "requiring_grad",
    "saved_tensors_hooks_enabled",
    "is_wrapper_subclass",
    "rewraps_outputs",
    "install",
    "is_aten_op",
    "flops",
    "watch_storage_resizes",
    "set_version",
    "TorchDispatchMode",
    "checkpoint_options",
    "subclass_functions_enabled",
    "Hidden",
    "subclass_functions",
    "torch_functions_off",
    "compiled",
]


# Id of the backward pass running on this thread, or -1 outside backward. Recompute
# happens once per backward pass, so values are keyed by the pass; autograd exposes no
# public notion of "which backward is this". (The native function itself: it runs at
# every unpack.)
current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id


def last_node() -> int:
    """The sequence number of the autograd node this thread made last: inside a pack hook,
    the node of the op saving the value (made before it saves; `Node._sequence_nr`)."""
    return torch._C._autograd._get_sequence_nr() - 1


# How many torch dispatch modes are active (outside torch's own infrastructure modes).
dispatch_modes: Callable[[], int] = torch._C._len_torch_dispatch_stack


def graph_retained() -> bool:
    """Whether the running backward pass keeps the graph (``retain_graph=True``).

    Compiled autograd holds every saved-tensor hook's packed object until its graph
    returns; a pass that frees the graph lets remat release them itself.
    """
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def queue_end_of_backward_callback(callback: Callable[[], Any]) -> bool:
    """Run ``callback`` when the current backward pass finishes, if the engine can.

    Lets a pass drop recomputed values it never unpacked (``inputs=`` can leave
    some nodes unexecuted). FSDP and DDP use the same engine hook; it has no
    public spelling. Compiled autograd takes such callbacks only when it compiles
    the whole backward as one graph: elsewhere under it, this returns False.
    """
    if in_compiled_autograd():
        return False
    torch.autograd.Variable._execution_engine.queue_callback(callback)
    return True


def dynamo_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, which Dynamo runs instead of tracing (imports Dynamo at its first call only)."""
    from torch._compile import _disable_dynamo

    return _disable_dynamo(fn)


def traced_under_functorch() -> bool:
    """While Dynamo traces: whether a ``torch.func`` transform is active.

    Dynamo folds ``peek_interpreter_stack`` to its real value (an interpreter or
    None), and ``isinstance`` on it; ``maybe_current_level`` would break the graph.
    """
    return isinstance(
        torch._C._functorch.peek_interpreter_stack(), torch._C._functorch.CInterpreter
    )


def inside_compiled_call() -> bool:
    """Whether a ``torch.compile``d function is running on this thread's Python stack.

    Dynamo compiles no frame while a user's dispatch mode is active: it runs it
    eagerly, silently. Its call wrapper (``compile_wrapper``) is then the only trace.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename.endswith("eval_frame.py"):
            return True
        frame = frame.f_back
    return False


def dispatch_keys() -> tuple[Any, Any]:
    """This thread's included and excluded dispatch keys."""
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


def dispatch_keys_set(keys: tuple[Any, Any]) -> Any:
    """A context with ``keys`` (from `dispatch_keys`) as this thread's dispatch keys.

    A custom op's body runs with autograd's keys excluded; a recompute inside one
    needs the forward's keys back.
    """
    return torch._C._ForceDispatchKeyGuard(*keys)


def register_opaque(cls: type, guard: Callable[[Any], list[Any]], read: tuple[str, ...]) -> None:
    """Let custom ops take ``cls`` instances, passed to a compiled graph by reference.

    ``guard`` gives what a compiled graph specializes on, and the attributes in
    ``read`` are read while tracing (their values are baked in; guard on them).
    ``cls`` subclasses `OpaqueBase`. torch has no public way to pass an object that
    is not a tensor to a custom op by reference.
    """
    from torch._library import opaque_object

    members = dict.fromkeys(read, opaque_object.MemberType.USE_REAL)
    register = getattr(opaque_object, "register_custom_class", None)  # torch 2.14's name
    if register is not None:  # the old name and "reference" log deprecations there
        register(cls, typ="symbolic", guard_fn=guard, members=members)
    else:
        opaque_object.register_opaque_type(cls, typ="reference", guard_fn=guard, members=members)


# torch.compile's frame callback, set (truthy) while a compiled call runs, also in a frame
# Dynamo gave up tracing and runs as is (there ``is_compiling()`` is False). A builtin:
# calling it makes no frame, which Dynamo would compile there.
compile_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def in_compiled_autograd() -> bool:
    """Whether compiled autograd is running the current backward (it has no public flag)."""
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")  # not imported by remat
    return compiled is not None and bool(compiled.in_compiled_autograd_region)


@contextlib.contextmanager
def saved_tensors_hooks_enabled() -> Iterator[None]:
    """Re-enable default saved-tensor hooks inside a block, then restore.

    ``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian`` disable them around
    the forward (``disable_saved_tensors_hooks``); there is no public way to
    turn them back on for a region that handles functorch wrappers itself.
    """
    message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    if message is None:
        yield
        return
    torch._C._autograd._saved_tensors_hooks_enable()
    try:
        yield
    finally:  # back to the disabled state, even with an outer region's hooks pushed
        torch._C._autograd._saved_tensors_hooks_disable(message, False)


_regions = threading.local()
_disable_saved_tensors_hooks = torch.autograd.graph.disable_saved_tensors_hooks


def running_regions() -> list[Any]:
    """The remat forwards and recomputes running on this thread, innermost last."""
    stack: list[Any] = _regions.__dict__.setdefault("stack", [])
    return stack


class region_running:  # noqa: N801 - a context manager, like torch.no_grad
    """Register a remat forward or recompute (any ``entry``) as running on this thread."""

    __slots__ = ("entry",)

    def __init__(self, entry: Any) -> None:
        self.entry = entry

    def __enter__(self) -> None:
        running_regions().append(self.entry)

    def __exit__(self, *exc: object) -> None:
        running_regions().pop()


@contextlib.contextmanager
def _disable_saved_tensors_hooks_in_regions(error_message: str) -> Iterator[None]:
    """``torch.autograd.graph.disable_saved_tensors_hooks``, usable inside a region.

    ``grad``/``vjp`` refuse to start while any saved-tensor hooks are pushed,
    so a transform inside a remat region would fail on the region's own hooks.
    Inside a region (and only there) they are disabled without that check:
    the transform's ops then save their tensors normally, and so does the
    recompute. Everywhere else torch's own behaviour is unchanged.
    """
    if not running_regions():
        with _disable_saved_tensors_hooks(error_message):
            yield
        return
    previous = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    torch._C._autograd._saved_tensors_hooks_disable(error_message, False)
    try:
        yield
    finally:
        if previous is None:
            torch._C._autograd._saved_tensors_hooks_enable()
        else:
            torch._C._autograd._saved_tensors_hooks_disable(previous, False)


def install() -> None:
    """Let torch.func transforms start inside remat regions (called once, by ``remat``).

    functorch looks ``disable_saved_tensors_hooks`` up on its module at call time,
    so remat swaps in `_disable_saved_tensors_hooks_in_regions`, which is torch's
    own function outside regions (``tests/test_torch_private.py`` checks that),
    and which torch.compile traces as it traces torch's.
    """
    torch.autograd.graph.disable_saved_tensors_hooks = _disable_saved_tensors_hooks_in_regions
    # Dynamo traces the function under that name as a context manager, listed when its
    # module is imported; one imported before remat listed torch's own.
    dynamo = sys.modules.get("torch._dynamo.variables.torch")
    if dynamo is not None:
        dynamo.supported_ctx_manager_classes[_disable_saved_tensors_hooks_in_regions] = None


# Python dispatch modes: torch's documented extension point, under a private module name.
TorchDispatchMode = _TorchDispatchMode
_every_op_made = False
_MAKING = threading.Lock()


def every_op_made() -> bool:
    return _every_op_made


def make_every_op() -> None:
    """Make the Python object (``torch.ops.<namespace>.<op>.<overload>``) of every op
    registered, once (0.2 s on torch 2.13 for its 3,600 ops).

    torch (2.11 to 2.15) makes an op's object when it first sends the op to a Python
    dispatch mode, and keeps a borrowed pointer to it: two threads making it at once each
    make one, one replaces the other, and torch goes on with a freed object. The process
    crashes (4 threads calling ``equal`` under a mode that does nothing: 8 runs of 20).
    """
    global _every_op_made
    with _MAKING:
        if _every_op_made:
            return
        for name in torch._C._dispatch_get_all_op_names():
            namespace, _, rest = name.partition("::")
            packet, _, overload = rest.partition(".")
            with contextlib.suppress(Exception):  # (an op torch.ops does not show)
                getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
        _every_op_made = True


_STORAGE_RESIZE = torch.UntypedStorage.resize_


def _resize_watched(storage: Any, size: int) -> Any:
    before = storage.nbytes()
    out = _STORAGE_RESIZE(storage, size)
    if storage.nbytes() != before:
        for mode in _get_current_dispatch_mode_stack():
            resized = getattr(mode, "storage_resized", None)
            if resized is not None:
                resized(storage)
    return out


def watch_storage_resizes() -> None:
    """Tell the dispatch modes of this thread about each ``UntypedStorage.resize_``.

    After a storage resizes itself to a new size, every active mode with a
    ``storage_resized`` method gets the storage. No dispatch mode sees the call
    itself: on CPU and CUDA the storage reallocates without an aten op (FSDP2 frees
    and re-gathers its unsharded parameters so), and torch has no hook for it.
    remat wraps the method (``remat.memory.track`` asks, on entry); the wrapper
    calls torch's, then looks at the mode stack, which torch also propagates to
    autograd's threads.
    """
    torch.UntypedStorage.resize_ = _resize_watched  # type: ignore[method-assign,assignment]


def is_aten_op(value: Any) -> bool:
    """Whether ``value`` is an aten operator (an overload or an overload packet)."""
    return isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def flops(op: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one aten op by torch's FLOP counter formulas (0 where it has none).

    ``flop_registry`` is the table `torch.utils.flop_counter.FlopCounterMode` reads;
    no public function evaluates one op's formula.
    """
    from torch.utils import flop_counter  # imported when a budget first plans

    formula = flop_counter.flop_registry.get(op.overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, out_val=out, **kwargs))
    except Exception:  # a formula that does not take these arguments: count none
        return 0


def functorch_interpreters() -> list[Any]:
    """The active ``torch.func`` transform levels, outermost first.

    The recompute must run at the forward's levels; functorch has no public
    view of its interpreter stack.
    """
    if not _F.get_dynamic_layer_stack_depth():  # (the usual case, checked first: it is cheap)
        return []
    return list(pyfunctorch.retrieve_all_functorch_interpreters())


_PLAIN = torch.empty(())  # made at import, outside any transform, so never wrapped


def level_witness(level: int) -> torch.Tensor:
    """A tiny tensor wrapped at a ``grad``/``jvp`` level, to tell later if it exited.

    Level numbers are positions and get reused; only a wrapper knows whether the
    level it was made at is still alive.
    """
    return _F._wrap_for_grad(_PLAIN, level)


def is_dead_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` wraps a functorch level that has exited."""
    return bool(_F.is_dead_tensor_wrapper(t))


# The recompute of a region whose transform levels exited (``vjp_fn`` called
# later, ``jacrev``, ``hessian``, backward after ``vmap``) re-creates those levels
# and re-wraps the inputs, as ``torch.func.grad`` and ``vmap`` do internally.
# torch.func offers no public way to run code at a level other than its own.


def wrapper_chain(t: torch.Tensor) -> list[tuple[int, int | None, bool]]:
    """The functorch wrappers around ``t``, outermost first.

    Each is ``(level, batch dim or None, requires_grad at that level)``.
    """
    chain = []
    while _F.is_functorch_wrapped_tensor(t):
        bdim = _F.maybe_get_bdim(t) if _F.is_batchedtensor(t) else None
        chain.append((int(_F.maybe_get_level(t)), bdim, bool(t.requires_grad)))
        t = _F.get_unwrapped(t)
    return chain


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The tensor inside one functorch wrapper, alive or dead."""
    return _F.get_unwrapped(t)


def unwrap_all(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside all of ``t``'s functorch wrappers."""
    while _F.is_functorch_wrapped_tensor(t):
        t = _F.get_unwrapped(t)
    return t


@contextlib.contextmanager
def levels_popped(count: int) -> Iterator[None]:
    """Temporarily pop the ``count`` innermost transform levels."""
    popped = [_F.pop_dynamic_layer_stack() for _ in range(count)]
    try:
        yield
    finally:
        for layer in reversed(popped):
            _F.push_dynamic_layer_stack(layer)


def functorch_cleared() -> contextlib.AbstractContextManager[None]:
    """Run plain tensor code outside every torch.func level (outside a dispatch mode)."""
    depth = int(_F.get_dynamic_layer_stack_depth())
    return levels_popped(depth) if depth else contextlib.nullcontext()


@contextlib.contextmanager
def new_grad_level() -> Iterator[int]:
    level = _F._grad_increment_nesting()
    try:
        yield level
    finally:
        _F._grad_decrement_nesting()


@contextlib.contextmanager
def new_vmap_level(batch_size: int, randomness: str) -> Iterator[int]:
    level = _F._vmap_increment_nesting(batch_size, randomness)
    try:
        yield level
    finally:
        _F._vmap_decrement_nesting()


@contextlib.contextmanager
def new_jvp_level() -> Iterator[int]:
    """A forward-mode level, entered as ``torch.func.jvp`` enters one."""
    from torch._functorch import eager_transforms as et

    with (
        et.jvp_increment_nesting() as level,
        fwAD._set_fwd_grad_enabled(True),
        # jvp keeps its own count of nested levels; only the outermost opens a dual level.
        fwAD.dual_level() if et.JVP_NESTING == 1 else contextlib.nullcontext(),
    ):
        yield level


def tangents(t: torch.Tensor, levels: list[int]) -> dict[int, torch.Tensor | None]:
    """The tangent of ``t`` at each forward-mode level it is wrapped at, unwrapped from it.

    A tangent is only read with its level innermost, so the levels inside it are
    popped for the read.
    """
    found: dict[int, torch.Tensor | None] = {}
    active = [int(i.level()) for i in functorch_interpreters()]
    while _F.is_functorch_wrapped_tensor(t):
        level = int(_F.maybe_get_level(t))
        if level in levels:
            with levels_popped(sum(other > level for other in active)):
                tangent = fwAD.unpack_dual(t).tangent
            if tangent is not None and int(_F.maybe_get_level(tangent)) == level:
                tangent = _F.get_unwrapped(tangent)
            found[level] = tangent
        t = _F.get_unwrapped(t)
    return found


def wrap_for_grad(t: torch.Tensor, level: int, requires_grad: bool) -> torch.Tensor:
    wrapped = _F._wrap_for_grad(t, level)
    if requires_grad:
        allowed = _F.get_inplace_requires_grad_allowed()
        _F.set_inplace_requires_grad_allowed(True)
        try:
            wrapped.requires_grad_()
        finally:
            _F.set_inplace_requires_grad_allowed(allowed)
    return wrapped


def _transform_backward_codes() -> tuple[Any, Any]:
    from torch._functorch import eager_transforms as et

    impl = et.grad_and_value_impl
    return et._autograd_grad.__code__, getattr(impl, "__wrapped__", impl).__code__


_AUTOGRAD_GRAD, _GRAD_AND_VALUE = _transform_backward_codes()


def in_grad_transform_backward() -> bool:
    """Whether the running backward is ``torch.func.grad``'s own pass.

    functorch always backpropagates with ``create_graph=True``, so every saved
    value a backward formula reads is recorded at the transform's level and
    held until ``grad`` returns, though nothing ever reads that level's graph.
    Only the call stack tells this pass from a user's ``autograd.grad`` inside
    ``fn``, whose graph may be read.
    """
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code is _AUTOGRAD_GRAD:
            caller = frame.f_back
            return caller is not None and caller.f_code is _GRAD_AND_VALUE
        frame = frame.f_back  # type: ignore[assignment]
    return False


def top_grad_level() -> int | None:
    """Level of the innermost transform if it is ``grad``, else None."""
    top = _F.peek_interpreter_stack()
    if top is None or top.key() != _F.TransformType.Grad:
        return None
    return int(top.level())


def dead_twin(t: torch.Tensor, level: int) -> torch.Tensor:
    """``t`` (wrapped at ``level``) rewrapped at a level that has already exited.

    A dead wrapper acts as its contents: ops at ``level`` then see a value with
    no history there, so nothing records it, while the levels below keep theirs.
    """
    inner = _F._unwrap_for_grad(t, level)
    with new_grad_level() as temporary:
        twin = _F._wrap_for_grad(inner, temporary)
    return twin


def requiring_grad(t: torch.Tensor) -> torch.Tensor:
    """A leaf alias of ``t`` that requires grad at ``t``'s outermost level."""
    if not _F.is_gradtrackingtensor(t):
        return t.detach().requires_grad_()
    level = _F.maybe_get_level(t)
    return wrap_for_grad(_F._unwrap_for_grad(t, level), level, requires_grad=True)


def detach_outermost(t: torch.Tensor) -> torch.Tensor:
    """Detach ``t`` from the autograd level that saved it, and from no other.

    A saved value's outermost wrapper is the level whose autograd saved it;
    ``Tensor.detach`` would also cut the graphs of the levels below, which
    higher-order transforms differentiate through.
    """
    if not _F.is_gradtrackingtensor(t):
        return t.detach()
    level = _F.maybe_get_level(t)
    return _F._wrap_for_grad(_F._unwrap_for_grad(t, level), level)


def add_batch_dim(t: torch.Tensor, bdim: int, level: int) -> torch.Tensor:
    return _F._add_batch_dim(t, bdim, level)


def wrapper_level(t: torch.Tensor) -> int:
    """Level of the outermost wrapper of ``t``: -1 for a plain tensor, -2 if dead."""
    return int(_F.maybe_get_level(t))


def rewraps_outputs(t: torch.Tensor) -> bool:
    """Whether ``t``'s type re-wraps op outputs in its ``__torch_function__``.

    ``torch.Tensor``'s own ``__torch_function__`` converts outputs with
    ``as_subclass``, an alias no dispatch mode sees; types that opt out (``Parameter``)
    set it to this private sentinel, which has no public name.
    """
    cls = type(t)
    return cls is not torch.Tensor and cls.__torch_function__ is not _NO_TORCH_FUNCTION


_NO_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def set_version(t: torch.Tensor, version: int) -> None:
    """Set the version counter of ``t``, a private copy no one else holds.

    A copy that stands for another tensor in a recompute must count versions from where
    that tensor did (its views share the count, its ``.data`` aliases start their own);
    torch has no public way to set a count.
    """
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def subclass_functions_enabled() -> bool:
    """Whether tensor subclasses' ``__torch_function__`` runs here.

    A subclass's own ``__torch_function__`` turns it off while it runs: a backward
    started inside one (``loss.backward()`` on a subclass) runs its hooks, and so
    remat's recompute, with it off.
    """
    return bool(torch._C._is_torch_function_enabled())


_INFRA = tuple(torch._C._TorchDispatchModeKey.__members__.values())
_NO_MODES = contextlib.nullcontext()


class Hidden:
    """Within the block, no torch function mode and no dispatch mode is active but torch's
    own (fake tensors, tracing, functionalization) and remat's meter (`remat.memory.track`,
    marked ``sees_remat``: remat's copies are memory too): remat's own calls (module
    snapshots, copies, comparisons) are no op of ``fn``'s, and a mode of the user's that
    changes values must not change them. `shown` puts the modes back for ``fn``'s call.

    The modes are popped and pushed back as they are, not exited and entered again:
    ``__enter__`` and ``__exit__`` may do more (`FlopCounterMode` resets its counts).
    torch has no public way to read or change the mode stacks.
    """

    __slots__ = ("dispatch", "functions", "meters")
    functions: Sequence[Any]
    dispatch: Sequence[Any]
    meters: Sequence[Any]

    def __enter__(self) -> Hidden:
        functions = torch._C._len_torch_function_stack()
        users = torch._C._len_torch_dispatch_stack()
        self.functions = self.dispatch = self.meters = ()  # (the usual: no mode)
        if functions:
            pop = torch._C._pop_torch_function_stack
            self.functions = [pop() for _ in range(functions)][::-1]  # (outermost first)
        if users:  # torch's own modes are popped last
            users -= sum(torch._C._get_dispatch_mode(key) is not None for key in _INFRA)
            pop = torch._C._pop_torch_dispatch_stack
            self.dispatch = [pop(None) for _ in range(users)][::-1]
            self.meters = [mode for mode in self.dispatch if getattr(mode, "sees_remat", False)]
            _push((), self.meters)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.functions or self.dispatch:
            _pop(0, len(self.meters))
            _push(self.functions, self.dispatch)

    def shown(self) -> contextlib.AbstractContextManager[Any]:
        """Within the block, the hidden modes are active again."""
        return self._shown() if self.functions or self.dispatch else _NO_MODES

    @contextlib.contextmanager
    def _shown(self) -> Iterator[None]:
        _pop(0, len(self.meters))
        _push(self.functions, self.dispatch)
        try:
            yield
        finally:
            _pop(len(self.functions), len(self.dispatch))
            _push((), self.meters)


def _push(functions: Sequence[Any], dispatch: Sequence[Any]) -> None:
    for mode in functions:
        torch._C._push_on_torch_function_stack(mode)
    for mode in dispatch:
        torch._C._push_on_torch_dispatch_stack(mode)


def _pop(functions: int, dispatch: int) -> None:
    for _ in range(functions):
        torch._C._pop_torch_function_stack()
    for _ in range(dispatch):
        torch._C._pop_torch_dispatch_stack(None)


def generator_identity(generator: torch.Generator) -> int:
    """Which C++ generator ``generator`` wraps: a dispatch mode is handed an explicit
    generator as another Python object, and two generators may share seed and state;
    torch has no public identity for them."""
    return int(generator._cdata)  # type: ignore[attr-defined]


def subclass_functions(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Within the block, subclasses' ``__torch_function__`` runs if ``enabled`` (as it did
    in the forward); torch has no public way to turn it back on."""
    if subclass_functions_enabled() == enabled:
        return contextlib.nullcontext()
    return torch._C._EnableTorchFunction() if enabled else torch._C.DisableTorchFunctionSubclass()


def torch_functions_off() -> contextlib.AbstractContextManager[Any]:
    """Within the block, no torch function mode or subclass ``__torch_function__`` runs:
    for remat's own calls inside its function mode, which the modes below it (the
    user's) must not see; torch has no public spelling of it."""
    return torch._C.DisableTorchFunction()


def compiled(obj: Any, in_place: bool = True) -> bool:
    """Whether ``obj`` is a module or function ``torch.compile`` made (not one
    ``torch.compiler.disable`` made, which runs eagerly), or (``in_place``) a module that
    ``Module.compile()`` compiled: Dynamo marks the first with the callable they wrap,
    ``Module.compile()`` sets a private attribute; neither is public."""
    if in_place and getattr(obj, "_compiled_call_impl", None) is not None:
        return True
    if getattr(obj, "_torchdynamo_orig_callable", None) is None:
        return False
    if isinstance(obj, torch.nn.Module):
        frames = sys.modules.get("torch._dynamo.eval_frame")
        return frames is None or not isinstance(obj.dynamo_ctx, frames.DisableContext)
    return not getattr(obj, "_torchdynamo_disable", False)


def inductor_thread(thread: threading.Thread) -> bool:
    """Whether ``thread`` is one of inductor's compile threads: a worker of its compile
    pool, or a thread of its subprocess pool (its reader, timer, health monitor or
    watchdog). They compile kernels and wait, and never draw random numbers; once a
    compile with more than one thread made them, they live as long as the process.
    torch names none of them publicly: a running thread's target is read from
    ``Thread._target``, which ``Thread.run`` drops once the target returns."""
    target = getattr(thread, "_target", None)
    owner = type(getattr(target, "__self__", None))
    if owner.__module__.startswith("torch._inductor.compile_worker."):
        return True
    compiling = sys.modules.get("torch._inductor.async_compile")
    if compiling is None or target is not futures_thread._worker:
        return False
    pool = compiling.AsyncCompile.pool
    return pool.cache_info().currsize > 0 and thread._args[0]() is pool()  # type: ignore[attr-defined]


def parametrization_cache() -> tuple[int, dict[Any, Any]]:
    """``torch.nn.utils.parametrize.cached()``'s state here: how many ``cached()`` blocks
    are open, and (in one) what the cache holds, a copy.

    A forward inside such a block computes a parametrized tensor once and reads it from
    the cache after; the recompute must start from the same cache. torch has no public
    way to read or set it.
    """
    depth = _parametrize._cache_enabled
    return depth, dict(_parametrize._cache) if depth else {}


@contextlib.contextmanager
def parametrization_cache_set(state: tuple[int, dict[Any, Any]]) -> Iterator[None]:
    """Within the block, `parametrization_cache` reads ``state`` (a fresh copy of its
    cache); after it, the caller's again."""
    caller = _parametrize._cache_enabled, _parametrize._cache
    _parametrize._cache_enabled, _parametrize._cache = state[0], dict(state[1])
    try:
        yield
    finally:
        _parametrize._cache_enabled, _parametrize._cache = caller


def _checkpoint_options() -> dict[str, Any]:
    from torch.utils.checkpoint import checkpoint

    parameters = inspect.signature(checkpoint).parameters
    return (
        {"respect_saved_tensors_hooks": True} if "respect_saved_tensors_hooks" in parameters else {}
    )


_CHECKPOINT_OPTIONS = _checkpoint_options()


def checkpoint_options() -> dict[str, Any]:
    """The options remat passes to ``torch.utils.checkpoint.checkpoint``, where torch has them.

    A public API, but not in every supported torch: ``respect_saved_tensors_hooks``
    (torch 2.14) routes what selective checkpointing keeps through the saved-tensor hooks
    around it (``save_on_cpu``), as autograd routes what it saves; unset, torch warns under
    such hooks, and it will change its default.
    """
    return dict(_CHECKPOINT_OPTIONS)

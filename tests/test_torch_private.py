"""Every private torch API remat relies on still behaves as remat assumes.

These tests exist so that a torch upgrade that changes one of them fails here, loudly,
instead of as a wrong gradient somewhere else.
"""

import contextlib
import inspect
import subprocess
import sys
import weakref
from typing import ClassVar

import pytest
import torch
import torch.utils.flop_counter
from torch.func import grad, jvp, vmap

from remat import _torch_private as tp


def _kinds():
    return [i.key().name for i in tp.functorch_interpreters()]


def _hooks(packed):
    return torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t)


def _push_hooks():
    """Enter and leave a saved-tensors-hooks context; return how many values it packed."""
    packed = []
    with _hooks(packed):
        pass
    return packed


def test_every_private_api_is_tested_here():
    """Each name in `remat._torch_private.__all__` is exercised by this file."""
    source = inspect.getsource(inspect.getmodule(test_every_private_api_is_tested_here))
    untested = [name for name in tp.__all__ if f"tp.{name}(" not in source]
    assert untested == []


def test_dynamo_disabled_runs_eagerly_inside_a_compiled_function():
    seen = []

    def probe(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    untraced = tp.dynamo_disabled(probe)
    compiled = torch.compile(lambda x: untraced(x.sin()).cos(), backend="eager")
    x = torch.randn(3)
    assert torch.equal(compiled(x), (x.sin() + 1).cos())
    assert seen == [False]  # run, not traced


class _GraphTaskProbe(torch.autograd.Function):
    ids: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _GraphTaskProbe.ids.append(tp.current_graph_task_id())
        return g


def test_traced_under_functorch_sees_a_transform_while_dynamo_traces():
    seen = []

    def f(x):
        seen.append(tp.traced_under_functorch())
        return x.sin().sum()

    x = torch.randn(3)
    torch.compile(f, backend="eager", fullgraph=True)(x)
    torch.compile(torch.func.grad(f), backend="eager", fullgraph=True)(x)
    assert seen == [False, True]
    assert tp.traced_under_functorch() is False


def test_inside_compiled_call_sees_a_compiled_function_run_under_a_dispatch_mode():
    seen = []

    class Probe(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(tp.inside_compiled_call())
            return func(*args, **(kwargs or {}))

    compiled = torch.compile(lambda x: x.sin(), backend="eager")
    untraced = tp.dynamo_disabled(lambda x: x.cos())
    x = torch.randn(3)
    with Probe():
        x.exp()
        compiled(x)
        untraced(x)
    assert seen == [False, True, False]


class _Token(tp.OpaqueBase):
    def __init__(self, scale: float) -> None:
        self.scale = scale


tp.register_opaque(_Token, lambda token: [token.scale], read=("scale",))


@torch.library.custom_op("remat_tests::scaled", mutates_args=())
def _scaled(token: _Token, x: torch.Tensor) -> torch.Tensor:
    return x * token.scale


@_scaled.register_fake
def _(token, x):
    return torch.empty_like(x)


def test_register_opaque_passes_objects_to_a_compiled_graph_guarded_by_what_is_read():
    base = tp.OpaqueBase()
    assert weakref.ref(base)() is base  # remat holds its handles weakly
    compiled = torch.compile(
        lambda token, x: torch.ops.remat_tests.scaled(token, x).sin(),
        backend="eager",
        fullgraph=True,
    )
    x = torch.randn(3)
    assert torch.equal(compiled(_Token(2.0), x), (x * 2).sin())
    torch._dynamo.config.error_on_recompile = True
    try:  # another object, the same guarded value: no recompile
        assert torch.equal(compiled(_Token(2.0), x), (x * 2).sin())
    finally:
        torch._dynamo.config.error_on_recompile = False


def test_dispatch_keys_set_gives_a_custom_op_autograd_back():
    keys = tp.dispatch_keys()
    seen = []

    @torch.library.custom_op("remat_tests::records", mutates_args=())
    def records(x: torch.Tensor) -> torch.Tensor:
        w = torch.ones(1, requires_grad=True)
        with torch.enable_grad():
            seen.append((x * w).grad_fn is not None)
            with tp.dispatch_keys_set(keys):
                seen.append((x * w).grad_fn is not None)
        return x.clone()

    records(torch.randn(2))
    assert seen == [False, True]


def test_current_graph_task_id():
    """-1 outside backward; a non-negative int inside, distinct for each backward pass."""
    assert tp.current_graph_task_id() == -1
    _GraphTaskProbe.ids = []
    from_hooks = []
    x = torch.ones(3, requires_grad=True)
    y = _GraphTaskProbe.apply(x)
    y.register_hook(lambda g: from_hooks.append(tp.current_graph_task_id()))
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    first, second = _GraphTaskProbe.ids
    assert all(type(i) is int and i >= 0 for i in (first, second))
    assert first != second
    assert from_hooks == [first, second]
    assert tp.current_graph_task_id() == -1


def test_last_node_in_a_pack_hook_is_the_node_of_the_op_saving():
    """Inside a pack hook, `last_node` is the sequence number of the saving op's node, made
    before it saves; the next op's nodes come after it."""
    seen = []
    x = torch.ones(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(tp.last_node()) or t, id):
        y = x.exp()  # saves its result, after it runs
        z = y.sin()  # saves its argument, before it runs
    assert seen == [y.grad_fn._sequence_nr(), z.grad_fn._sequence_nr()]
    assert z.grad_fn._sequence_nr() > y.grad_fn._sequence_nr()


def test_dispatch_modes_counts_the_active_torch_dispatch_modes():
    assert tp.dispatch_modes() == 0
    with tp.TorchDispatchMode():
        assert tp.dispatch_modes() == 1
        with tp.TorchDispatchMode():
            assert tp.dispatch_modes() == 2
    assert tp.dispatch_modes() == 0


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not")
def test_in_compiled_autograd_is_true_only_while_compiled_autograd_runs_a_backward():
    from torch._dynamo import compiled_autograd

    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x.sin()
    y.register_hook(lambda g: seen.append(tp.in_compiled_autograd()) or g)
    y.sum().backward(retain_graph=True)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        y.sum().backward()
    assert seen == [False, True]
    assert not tp.in_compiled_autograd()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_autograd"])
def test_graph_retained_answers_for_the_running_pass(compiled):
    """Read by an unpack hook, as remat does, in the engine and under compiled autograd."""
    from torch._dynamo import compiled_autograd

    seen = []
    unpack = tp.dynamo_disabled(lambda t: seen.append(tp.graph_retained()) or t)
    for retain in (False, True):
        x = torch.ones(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = x.sin()
        compiler = torch.compile(backend="eager")
        with compiled_autograd._enable(compiler) if compiled else contextlib.nullcontext():
            y.sum().backward(retain_graph=retain)
    assert seen == [False, True]


def test_queue_end_of_backward_callback_runs_after_the_pass():
    """A callback queued during backward runs once, after every node, including leaf grads."""
    events = []
    x = torch.ones(3, requires_grad=True)
    y = x.sin()

    def callback():
        events.append(("callback", x.grad is not None, tp.current_graph_task_id()))

    def hook(g):
        events.append(("hook", x.grad is not None, tp.current_graph_task_id()))
        tp.queue_end_of_backward_callback(callback)
        return g

    y.register_hook(hook)
    y.sum().backward()
    (_, before, task), (name, after, same_task) = events
    assert (before, name, after) == (False, "callback", True)
    assert same_task == task


def test_saved_tensors_hooks_enabled_inside_grad():
    """Inside ``torch.func.grad`` hooks raise; the context re-enables them, then restores."""
    observed = {}

    def f(x):
        with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
            _push_hooks()
        packed = []
        with (
            tp.saved_tensors_hooks_enabled(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t),
        ):
            y = x.sin()
        observed["packed"] = len(packed)
        with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
            _push_hooks()
        with pytest.raises(ValueError, match="inside"), tp.saved_tensors_hooks_enabled():
            raise ValueError("inside")
        with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
            _push_hooks()
        return y.sum()

    x = torch.linspace(-1, 1, 5)
    assert torch.equal(grad(f)(x), x.cos())
    assert observed["packed"] == 1


def test_saved_tensors_hooks_enabled_outside_transforms_is_a_no_op():
    """Outside transforms hooks work before, inside and after the context."""
    assert _push_hooks() == []
    with tp.saved_tensors_hooks_enabled():
        _push_hooks()
    _push_hooks()


def test_region_running_lets_grad_start_under_hooks():
    """Under hooks, ``grad`` starts only inside `region_running`; the hooks pack again after."""
    x = torch.linspace(-1, 1, 5)
    packed = []
    with _hooks(packed), pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        grad(lambda x: x.sin().sum())(x)
    with tp.region_running("entry"), _hooks(packed):
        assert tp.running_regions() == ["entry"]
        assert torch.equal(grad(lambda x: x.sin().sum())(x), x.cos())
        assert packed == []
        torch.ones(2, requires_grad=True).sin()
        assert len(packed) == 1
    assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None
    with pytest.raises(ValueError, match="inside"), tp.region_running("entry"):
        raise ValueError("inside")
    assert tp.running_regions() == []
    with _hooks(packed), pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        grad(lambda x: x.sin().sum())(x)


def test_functorch_interpreters():
    """[] outside transforms; one entry per level, outermost first, inside them."""
    assert tp.functorch_interpreters() == []
    seen = {}

    def f(x):
        seen["kinds"] = _kinds()
        seen["levels"] = [i.level() for i in tp.functorch_interpreters()]
        seen["vmap"] = tp.functorch_interpreters()[0].batch_size()
        return x.sin().sum()

    vmap(grad(f))(torch.ones(4, 3))
    assert seen == {"kinds": ["Vmap", "Grad"], "levels": [1, 2], "vmap": 4}
    jvp(lambda x: seen.update(jvp=_kinds()) or x.sin(), (torch.ones(2),), (torch.ones(2),))
    assert seen["jvp"] == ["Jvp"]
    assert tp.functorch_interpreters() == []


def test_level_witness_dies_with_its_level():
    """A witness is alive inside its grad level and dead once that level exits."""
    witnesses = {}

    def inner(x):
        outer_level, inner_level = (i.level() for i in tp.functorch_interpreters())
        witnesses["outer"] = tp.level_witness(outer_level)
        witnesses["inner"] = tp.level_witness(inner_level)
        assert not tp.is_dead_wrapper(witnesses["outer"])
        assert not tp.is_dead_wrapper(witnesses["inner"])
        return x.sin().sum()

    def outer(x):
        g = grad(inner)(x)
        witnesses["after_inner"] = [tp.is_dead_wrapper(witnesses[k]) for k in ("outer", "inner")]
        return g.sum()

    grad(outer)(torch.ones(3))
    assert witnesses["after_inner"] == [False, True]
    assert tp.is_dead_wrapper(witnesses["outer"])
    assert tp.is_dead_wrapper(witnesses["inner"])
    assert not tp.is_dead_wrapper(torch.ones(2))


def test_wrapper_chain_unwrap_and_wrapper_level():
    """In vmap(grad(f)) an input is a grad wrapper over a batched tensor, dead after exit."""
    seen = {}

    def f(x):
        seen["chain"] = tp.wrapper_chain(x)
        seen["inner"] = tp.wrapper_chain(tp.unwrap(x))
        seen["level"] = tp.wrapper_level(x)
        seen["y"] = y = x.sin()
        return y.sum()

    vmap(grad(f))(torch.ones(2, 3))
    assert seen["chain"] == [(2, None, True), (1, 0, False)]
    assert seen["inner"] == [(1, 0, False)]
    assert seen["level"] == 2
    assert tp.wrapper_level(seen["y"]) == -2
    assert tp.wrapper_level(torch.ones(2)) == -1
    assert tp.wrapper_chain(torch.ones(2)) == []


def test_levels_popped_and_restored():
    """``levels_popped(n)`` hides the n innermost levels inside the block only."""
    seen = {}

    def f(x):
        with tp.levels_popped(1):
            seen["popped"] = _kinds()
        seen["restored"] = _kinds()
        return x.sin().sum()

    vmap(grad(f))(torch.ones(2, 3))
    assert seen == {"popped": ["Vmap"], "restored": ["Vmap", "Grad"]}


def test_new_grad_level_and_wrap_for_grad():
    """A new grad level differentiates tensors wrapped at it, and exits with the block."""
    a, b = torch.linspace(0, 1, 3), torch.ones(3)
    with tp.new_grad_level() as level:
        assert [i.get_state() for i in tp.functorch_interpreters()] == [("Grad", level, True)]
        t = tp.wrap_for_grad(a, level, True)
        u = tp.wrap_for_grad(b, level, False)
        assert tp.wrapper_chain(t) == [(level, None, True)]
        assert tp.wrapper_chain(u) == [(level, None, False)]
        (g,) = torch.autograd.grad((t * t * u).sum(), t)
        assert torch.equal(tp.unwrap(g), 2 * a)
    assert tp.functorch_interpreters() == []
    assert tp.is_dead_wrapper(t)
    assert tp.unwrap(t) is a


def test_new_vmap_level_and_add_batch_dim():
    """A new vmap level has the given size and randomness; add_batch_dim batches at it."""
    c = torch.arange(8.0).reshape(2, 4)
    with tp.new_vmap_level(4, "different") as level:
        (interpreter,) = tp.functorch_interpreters()
        assert interpreter.get_state() == ("Vmap", level, "different")
        assert interpreter.batch_size() == 4
        batched = tp.add_batch_dim(c, 1, level)
        assert batched.shape == (2,)
        assert tp.wrapper_chain(batched) == [(level, 1, False)]
        assert torch.equal(tp.unwrap(batched), c)
    assert tp.functorch_interpreters() == []


def test_new_jvp_level_carries_tangents_of_duals_made_at_it():
    """A new jvp level, like jvp's own: make_dual works at it, tangents propagate, it exits."""
    a, tangent = torch.linspace(0, 1, 3), torch.full((3,), 2.0)
    with tp.new_jvp_level() as level:
        assert [i.get_state() for i in tp.functorch_interpreters()] == [("Jvp", level, True)]
        dual = torch.autograd.forward_ad.make_dual(a, tangent)
        assert tp.wrapper_level(dual) == level
        out = torch.autograd.forward_ad.unpack_dual(dual * dual).tangent
        assert torch.equal(tp.unwrap(out), 2 * a * tangent)
        with tp.new_jvp_level():  # nested, as jvp nests: no second dual level is opened
            pass
    assert tp.functorch_interpreters() == []
    assert torch.autograd.forward_ad._current_level == -1


def test_tangents_at_each_forward_mode_level_under_inner_levels():
    """Tangents per jvp level, unwrapped from it, also under grad levels inside it."""
    x, t = torch.linspace(0, 1, 3), torch.full((3,), 3.0)
    seen = {}

    def inner(x):
        levels = [i.level() for i in tp.functorch_interpreters() if i.key().name == "Jvp"]
        seen.update(tp.tangents(x, levels))
        return x.sin().sum()

    jvp(grad(inner), (x,), (t,))
    ((level, tangent),) = seen.items()
    assert level == 1  # jvp's, the outermost; grad's is 2
    assert torch.equal(tangent, t)

    seen.clear()
    grad(inner)(x)  # no forward-mode level: nothing
    assert seen == {}


def test_top_grad_level():
    """The innermost level if it is grad, else None."""
    seen = []

    def f(x):
        seen.append(tp.top_grad_level())
        return x.sin().sum()

    grad(f)(torch.ones(3))
    vmap(grad(f))(torch.ones(2, 3))
    grad(lambda x: vmap(f)(x).sum())(torch.ones(2, 3))
    assert seen == [1, 2, None]
    assert tp.top_grad_level() is None


def test_in_grad_transform_backward():
    """True in ``grad``'s own backward only: not in ``autograd.grad`` inside fn, nor eager."""
    seen = []

    def f(x):
        y = x.sin()
        y.register_hook(lambda g: seen.append(tp.in_grad_transform_backward()))
        torch.autograd.grad(y.sum(), x, create_graph=True)
        seen.append("user pass done")
        return y.sum()

    grad(f)(torch.ones(3))
    x = torch.ones(3, requires_grad=True)
    y = x.sin()
    y.register_hook(lambda g: seen.append(tp.in_grad_transform_backward()))
    y.sum().backward()
    assert seen == [False, "user pass done", True, False]
    assert tp.in_grad_transform_backward() is False


def test_dead_twin():
    """A dead twin holds the same contents under a wrapper whose level has exited."""
    seen = {}

    def f(x):
        y = x.sin()
        twin = tp.dead_twin(y, tp.top_grad_level())
        seen["dead"] = tp.is_dead_wrapper(twin)
        seen["level"] = tp.wrapper_level(twin)
        seen["same"] = torch.equal(tp.unwrap(twin), tp.unwrap(y))
        seen["still_top"] = tp.top_grad_level()
        return y.sum()

    grad(f)(torch.ones(3))
    assert seen == {"dead": True, "level": -2, "same": True, "still_top": 1}


def test_detach_outermost_keeps_outer_levels():
    """Detaching from the innermost grad level leaves the outer level's graph intact."""

    def inner(x):
        return (tp.detach_outermost(x.sin()) * x).sum()  # d/dx = sin(x), still tracked outside

    x = torch.linspace(-1, 1, 5)
    assert torch.allclose(grad(lambda x: grad(inner)(x).sum())(x), x.cos())
    plain = torch.ones(2, requires_grad=True)
    detached = tp.detach_outermost(plain * 2)
    assert not detached.requires_grad
    assert detached.grad_fn is None


def test_unwrap_all_reaches_the_plain_tensor():
    """unwrap_all peels every functorch wrapper, alive or not, down to the plain tensor."""
    seen = {}

    def f(x):
        seen["plain"] = tp.wrapper_level(tp.unwrap_all(x))
        return x.sin().sum()

    vmap(grad(f))(torch.ones(2, 3))
    assert seen == {"plain": -1}
    t = torch.ones(2)
    assert tp.unwrap_all(t) is t


def test_requiring_grad_at_the_outermost_level():
    """requiring_grad makes a leaf alias that requires grad at the value's own level."""
    plain = tp.requiring_grad(torch.ones(2))
    assert plain.requires_grad
    assert plain.is_leaf
    seen = {}

    def f(x):
        y = tp.requiring_grad(tp.detach_outermost(x * 2))
        seen["level"] = tp.wrapper_level(y)
        seen["requires_grad"] = y.requires_grad
        return (y * x).sum()

    grad(f)(torch.ones(3))
    assert seen == {"level": 1, "requires_grad": True}


def test_functorch_cleared_runs_outside_every_level():
    """Inside functorch_cleared no level is active, and the levels come back after."""
    seen = {}

    def f(x):
        with tp.functorch_cleared():
            seen["inside"] = tp.functorch_interpreters()
            seen["plain"] = tp.wrapper_level(torch.ones(2))
        seen["after"] = len(tp.functorch_interpreters())
        return x.sin().sum()

    vmap(grad(f))(torch.ones(2, 3))
    assert seen == {"inside": [], "plain": -1, "after": 2}
    with tp.functorch_cleared():
        assert tp.functorch_interpreters() == []


def test_rewraps_outputs_tells_subclasses_that_convert_outputs():
    """Plain tensors and Parameters do not re-wrap op outputs; a plain subclass does."""

    class Sub(torch.Tensor):
        pass

    t = torch.ones(2)
    assert not tp.rewraps_outputs(t)
    assert not tp.rewraps_outputs(torch.nn.Parameter(t))
    assert tp.rewraps_outputs(t.as_subclass(Sub))
    assert type(t.as_subclass(Sub).sin()) is Sub  # what makes remat index by storage


def test_is_wrapper_subclass_tells_dispatch_wrappers_from_other_tensors():
    """A ``__torch_dispatch__`` wrapper (TwoTensor, the kind DTensor is) holds its data in
    the tensors it wraps; plain tensors, Parameters and `__torch_function__` subclasses do
    not wrap."""
    from torch.testing._internal.two_tensor import TwoTensor

    class Sub(torch.Tensor):
        pass

    t = torch.ones(2)
    assert tp.is_wrapper_subclass(TwoTensor(t, t))
    assert not tp.is_wrapper_subclass(t)
    assert not tp.is_wrapper_subclass(torch.nn.Parameter(t))
    assert not tp.is_wrapper_subclass(t.as_subclass(Sub))


def test_subclass_functions_are_off_in_a_subclass_backward_and_turn_back_on():
    """``backward()`` on a subclass runs inside its ``__torch_function__``: subclass
    functions are off in the hooks, and `subclass_functions(True)` turns them back on."""

    class Sub(torch.Tensor):
        pass

    seen = []

    def unpack(t: torch.Tensor) -> torch.Tensor:
        seen.append(tp.subclass_functions_enabled())
        with tp.subclass_functions(True):
            seen.append(type(torch.ones(1).as_subclass(Sub).sin()).__name__)
        with tp.subclass_functions(False):
            seen.append(type(torch.ones(1).as_subclass(Sub).sin()).__name__)
        return t

    assert tp.subclass_functions_enabled()
    x = torch.ones(2).as_subclass(Sub).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = x.sin().sum()
    y.backward()
    assert seen == [False, "Sub", "Tensor"]


def test_generator_identity_names_the_generator_a_dispatch_mode_is_handed():
    """A dispatch mode gets an explicit generator as another Python object; its identity is
    the generator's, and differs from another generator's with the same seed and state."""
    from torch.utils._python_dispatch import TorchDispatchMode

    handed = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            handed.append((kwargs or {}).get("generator"))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(g.get_state(), torch.default_generator.get_state())
    assert tp.generator_identity(g) != tp.generator_identity(torch.default_generator)
    with Record():
        torch.rand(2, generator=g)
    assert handed[0] is not g
    assert tp.generator_identity(handed[0]) == tp.generator_identity(g)


def test_hidden_pops_the_modes_but_torchs_own_and_shown_pushes_them_back():
    """`Hidden` pops every function mode and every dispatch mode but torch's own (fake
    tensors here), outermost first, and puts them back; `shown` pushes them for a block
    without entering them again (`FlopCounterMode` would start over). Autograd runs
    saved-tensor hooks with no function mode (why remat enters the forward's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils.flop_counter import FlopCounterMode

    def stacks():
        functions = torch._C._len_torch_function_stack()
        dispatch = torch._C._len_torch_dispatch_stack()
        return (
            [torch._C._get_function_stack_at(i) for i in range(functions)],
            [torch._C._get_dispatch_stack_at(i) for i in range(dispatch)],
        )

    class Through(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with tp.Hidden() as hidden:
        assert len(hidden.functions) + len(hidden.dispatch) == 0
        assert stacks() == ([], [])
        assert isinstance(hidden.shown(), contextlib.nullcontext)
    flops = FlopCounterMode(display=False)
    fake = FakeTensorMode()
    with fake, torch.device("cpu"), Through() as through, flops:
        x, w = torch.ones(4, 4), torch.ones(4, 4)
        before = stacks()
        with tp.Hidden() as hidden:
            assert hidden.functions[1:] == [through]  # (after torch.device's)
            assert len(hidden.dispatch) == 1  # (FlopCounterMode's own)
            assert stacks() == ([], [fake])
            (x @ w).sum()  # fake, and no FLOP counted
            with hidden.shown():
                assert stacks() == before
                x @ w
            assert stacks() == ([], [fake])
        assert stacks() == before
        seen = []
        y = torch.ones(2, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: seen.append(stacks()[0]) or t
        ):
            z = y.sin().sum()
    z.backward()
    assert seen == [[]]
    from remat.memory import track

    with FlopCounterMode(display=False), track() as meter, FlopCounterMode(display=False):
        before = stacks()
        with tp.Hidden() as hidden:  # remat's meter stays: remat's copies are memory too
            assert stacks() == ([], [meter])
            with hidden.shown():
                assert stacks() == before
            assert stacks() == ([], [meter])
        assert stacks() == before
    assert flops.get_total_flops() == 2 * 4 * 4 * 4


def test_install_leaves_torch_alone_outside_regions():
    """After `install`, outside regions torch.func still refuses to start under pushed hooks."""
    tp.install()
    assert torch.autograd.graph.disable_saved_tensors_hooks.__name__ == (
        "_disable_saved_tensors_hooks_in_regions"
    )
    x = torch.ones(3)
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with hooks, pytest.raises(RuntimeError, match="saved tensor hooks"):
        torch.func.grad(lambda x: x.sin().sum())(x)
    assert torch.equal(torch.func.grad(lambda x: x.sin().sum())(x), x.cos())


def test_install_lets_a_dynamo_imported_before_remat_trace_func_transforms():
    """torch.compile traces ``grad`` over a region whether Dynamo or remat was imported first
    (transformers, for one, imports Dynamo)."""
    program = """
import torch, torch._dynamo.variables.torch
import remat

def loss(w, x):
    return remat.remat(lambda x: (x * w).sin())(x).sum()

w, x = torch.randn(3), torch.randn(3)
grad = torch.func.grad(loss)
compiled = torch.compile(grad, backend="aot_eager", fullgraph=True)
assert torch.allclose(compiled(w, x), grad(w, x))
"""
    subprocess.run([sys.executable, "-c", program], check=True, timeout=300)


def test_is_aten_op_and_dispatch_mode():
    """is_aten_op tells operators (overloads and packets) from other callables."""
    assert tp.is_aten_op(torch.ops.aten.mm)
    assert tp.is_aten_op(torch.ops.aten.mm.default)
    assert not tp.is_aten_op(torch.mm)
    seen = []

    class Mode(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        torch.ones(2).sin()
    assert torch.ops.aten.sin.default in seen
    assert isinstance(tp.TorchDispatchMode(), torch.utils._python_dispatch.TorchDispatchMode)


def test_storage_resize_is_no_aten_op():
    """UntypedStorage.resize_ reaches no dispatch mode: remat.memory.track watches it itself."""
    seen = []

    class Mode(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    storage = torch.empty(4).untyped_storage()
    with Mode():
        assert tp._STORAGE_RESIZE(storage, 0) is storage
        tp._STORAGE_RESIZE(storage, 32)
    assert seen == []
    assert storage.nbytes() == 32


def test_watch_storage_resizes_tells_modes_and_leaves_torch_alone():
    """After `watch_storage_resizes`, resize_ works as torch's; active modes hear of it."""
    tp.watch_storage_resizes()
    storage = torch.arange(4.0).untyped_storage()
    assert storage.resize_(8) is storage
    assert storage.nbytes() == 8
    heard = []

    class Listening(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

        def storage_resized(self, resized):
            heard.append((resized, resized.nbytes()))

    with Listening():
        storage.resize_(8)  # the same size: nothing to hear
        storage.resize_(24)
    assert heard == [(storage, 24)]


def test_flops_reads_torch_flop_counter_formulas():
    """`flops` gives FlopCounterMode's count for one op, and 0 for ops without a formula."""
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    out = a @ b
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        torch.mm(a, b)
    assert tp.flops(torch.ops.aten.mm.default, (a, b), {}, out) == counter.get_total_flops() == 120
    assert tp.flops(torch.ops.aten.sin.default, (a,), {}, a.sin()) == 0
    assert tp.flops(torch.ops.aten.mm.default, (a,), {}, out) == 0  # a formula that cannot apply


def test_set_version_sets_the_count_views_share_and_data_does_not():
    """`set_version` sets a tensor's version count; its views share it, `.data` has its own."""
    t = torch.zeros(3)
    tp.set_version(t, 7)
    view = t.detach()
    data = t.data
    assert (t._version, view._version, data._version) == (7, 7, 0)
    view.add_(1)
    assert (t._version, data._version) == (8, 0)


def test_checkpoint_options_are_those_this_torch_takes():
    """`respect_saved_tensors_hooks=True` where torch's checkpoint has it (2.14 on), else none."""
    parameters = inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    options = tp.checkpoint_options()
    assert options.keys() <= parameters.keys()
    has = "respect_saved_tensors_hooks" in parameters
    assert options == ({"respect_saved_tensors_hooks": True} if has else {})


def test_parametrization_cache_reads_and_sets_the_cached_block_state():
    """`parametrization_cache` reads what ``parametrize.cached()`` caches (a copy), and
    `parametrization_cache_set` makes the parametrized weight read that state: computed
    afresh into a cache of its own, or the cached tensor; then the caller's again."""
    from torch.nn.utils import parametrize

    linear = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(3, 3))
    assert tp.parametrization_cache() == (0, {})
    with parametrize.cached():
        weight = linear.weight
        depth, cache = tp.parametrization_cache()
        assert depth == 1
        assert [v is weight for v in cache.values()] == [True]
        assert linear.weight is weight
        with tp.parametrization_cache_set((1, {})):
            fresh = linear.weight
            assert fresh is not weight
            assert linear.weight is fresh  # cached in the block's own cache
        with tp.parametrization_cache_set((0, {})):
            assert linear.weight is not linear.weight  # not cached
        with tp.parametrization_cache_set((depth, cache)):
            assert linear.weight is weight
        assert linear.weight is weight
    assert tp.parametrization_cache() == (0, {})


def test_torch_functions_off_hides_calls_from_function_modes_and_subclasses():
    """Inside `torch_functions_off`, neither a torch function mode nor a subclass's
    ``__torch_function__`` sees a call; after it, both do again."""
    seen: list[str] = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append("subclass")
            return super().__torch_function__(func, types, args, kwargs or {})

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append("mode")
            return func(*args, **(kwargs or {}))

    x = torch.ones(2).as_subclass(Sub)
    with Mode():
        with tp.torch_functions_off():
            x.tolist()
        assert seen == []
        x.tolist()
    assert seen == ["mode", "subclass"]


def test_compiled_tells_what_torch_compile_made_from_what_disable_made():
    """`compiled`: a module or function torch.compile made; not one torch.compiler.disable
    made (it runs eagerly), nor a plain one."""
    linear = torch.nn.Linear(2, 2)
    assert tp.compiled(torch.compile(linear))
    assert tp.compiled(torch.compile(torch.sin))
    assert not tp.compiled(torch.compiler.disable(linear))
    assert not tp.compiled(torch.compiler.disable(torch.sin))
    assert not tp.compiled(linear)
    assert not tp.compiled(torch.sin)
    linear.compile()
    assert tp.compiled(linear)
    assert not tp.compiled(linear, in_place=False)


def test_inductor_thread_tells_inductors_compile_threads_from_others():
    """The threads of inductor's subprocess pool and the workers of its compile pool are
    inductor's; a worker of another pool and a thread of the user's are not."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from torch._inductor.compile_worker.subproc_pool import SubprocPool

    from tests.helpers import another_thread_alive, inductor_pool_alive

    before = set(threading.enumerate())
    subprocesses = SubprocPool(1)
    try:
        made = [t for t in threading.enumerate() if t not in before]
        assert made
        assert all(tp.inductor_thread(t) for t in made)
    finally:
        subprocesses.shutdown()
    with inductor_pool_alive() as workers:
        assert workers
        assert all(tp.inductor_thread(t) for t in workers)
    with ThreadPoolExecutor(1) as other:
        other.submit(lambda: None).result()
        assert not any(tp.inductor_thread(t) for t in other._threads)
    with another_thread_alive():
        assert not any(tp.inductor_thread(t) for t in threading.enumerate())

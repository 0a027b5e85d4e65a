"""The hook engine's promises, checked by counting what runs and what stays alive."""

import collections
import gc
import re
import threading
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat import RecomputeError, _engine, memory, remat
from remat import apply as remat_apply
from remat import policies as remat_policies
from tests.helpers import POLICIES, OpCounter


def _vector(seed=0, n=1000):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen, dtype=torch.float64).requires_grad_()


def _nbytes(t):
    return t.untyped_storage().nbytes()


@pytest.fixture
def regions(monkeypatch):
    """Weak references to every `Region` constructed while the test runs."""
    made = []
    init = _engine.Region.__init__

    def spy(self, *args, **kwargs):
        made.append(weakref.ref(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(_engine.Region, "__init__", spy)
    return made


def test_recompute_runs_once_per_backward_pass():
    """Several saved values unpacked in one backward pass cost one re-run of ``fn``."""
    calls = collections.Counter()

    def fn(x):
        calls["fn"] += 1
        return x.sin().tanh().exp()  # tanh and exp each save their output

    x = _vector()
    with OpCounter() as forward:
        y = remat(fn)(x)
    with OpCounter() as backward:
        y.sum().backward()
    assert calls["fn"] == 2
    assert forward.counts["aten.sin"] == forward.counts["aten.tanh"] == 1
    assert backward.counts["aten.sin"] == backward.counts["aten.tanh"] == 1
    assert backward.counts["aten.exp"] == 1
    assert torch.equal(x.grad, torch.autograd.grad(fn(x).sum(), x)[0])


def test_early_stop_skips_work_after_last_saved_value():
    """Code and ops after the last op that saves a tensor do not run in the recompute."""
    calls = collections.Counter()

    def fn(x):
        calls["start"] += 1
        y = x.sin().exp()
        calls["after"] += 1
        return y + 1  # add saves nothing for backward

    x = _vector()
    y = remat(fn)(x)
    with OpCounter() as backward:
        y.sum().backward()
    assert calls == {"start": 2, "after": 1}
    assert backward.counts["aten.exp"] == 1
    assert backward.counts["aten.add"] == 0


def test_early_stop_before_op_whose_input_is_last_saved_value():
    """When the last saved value is an op's input, that op itself is not re-run."""

    def fn(x):
        return x.exp().sin()  # sin saves its input, before it runs

    x = _vector()
    y = remat(fn)(x)
    with OpCounter() as backward:
        y.sum().backward()
    assert backward.counts["aten.exp"] == 1
    assert backward.counts["aten.sin"] == 0


_RRELU = {
    "F.rrelu": lambda: lambda x: F.rrelu(x, training=True),
    "F.rrelu*2": lambda: lambda x: F.rrelu(x, training=True) * 2,
    "Linear-RReLU": lambda: nn.Sequential(nn.Linear(4, 4), nn.RReLU()).double(),
    "residual": lambda: _Residual(nn.Sequential(nn.Linear(4, 4), nn.RReLU()).double()),
}


class _Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("make", _RRELU.values(), ids=_RRELU.keys())
@pytest.mark.parametrize("transform", ["eager", "grad"])
def test_early_stop_lets_an_op_fill_a_value_it_saved_empty(make, policy, transform):
    """rrelu in training saves its noise tensor empty, then fills it (no version bump).
    When it saves the last needed value, the recompute lets it run: gradients are plain's,
    where they were read from memory nothing wrote (torch.utils.checkpoint's still are)."""

    def grads(wrap):
        torch.manual_seed(0)
        fn = make()
        x = torch.linspace(-2, 2, 12, dtype=torch.float64).view(3, 4)
        torch.manual_seed(1)
        if transform == "grad":
            return torch.func.grad(lambda x: wrap(fn)(x).sum())(x)
        x.requires_grad_()
        wrap(fn)(x).sum().backward()
        return x.grad

    assert torch.equal(grads(lambda f: remat(f, policy=policy)), grads(lambda f: f))


def test_retain_graph_recomputes_once_per_pass():
    """With ``retain_graph=True``, each backward pass re-runs ``fn`` once, same grads."""
    calls = []

    def fn(x):
        calls.append(None)
        return x.sin().tanh().exp()

    x = _vector()
    y = remat(fn)(x)
    first = torch.autograd.grad(y.sum(), x, retain_graph=True)
    assert len(calls) == 2
    second = torch.autograd.grad(y.sum(), x, retain_graph=True)
    assert len(calls) == 3
    (expected,) = torch.autograd.grad(fn(x).sum(), x)
    assert torch.equal(first[0], expected)
    assert torch.equal(second[0], expected)


class _ReadsTwice(torch.autograd.Function):
    """Reads ``ctx.saved_tensors`` twice in its backward, holding the first (``hold``) or not."""

    @staticmethod
    def forward(ctx, x, hold):  # type: ignore[no-untyped-def, override]
        y = x.exp()
        ctx.save_for_backward(y)
        ctx.hold = hold
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        first = ctx.saved_tensors[0] if ctx.hold else ctx.saved_tensors[0].sum()
        second = ctx.saved_tensors[0]  # (``first`` is alive; the value itself only if held)
        assert first.ndim == (1 if ctx.hold else 0)
        return grad * second, None


@pytest.mark.parametrize("hold", [True, False], ids=["first-held", "first-dropped"])
def test_value_unpacked_twice_in_one_pass(hold):
    """A backward that reads a saved value (a custom function's output) twice gets the first
    read's memory back while that is alive (one re-run of ``fn`` in all), and else a re-run
    for that value alone; the gradient is plain's either way. (Autograd hands the function a
    new tensor on that memory, not what the unpack hook returned.)"""
    calls = []

    def fn(x):
        calls.append(None)
        return _ReadsTwice.apply(x.sin(), hold)

    x = _vector()
    remat(fn)(x).sum().backward()
    assert len(calls) == (3 if not hold else 2)
    (expected,) = torch.autograd.grad(fn(x).sum(), x)
    assert torch.equal(x.grad, expected)


SAVES = {
    "saves-inputs": lambda x: x.sin().cos().sin(),
    "saves-outputs": lambda x: x.sin().exp().tanh(),
}


@pytest.mark.parametrize("retain_graph", [False, True], ids=["free-graph", "retain-graph"])
@pytest.mark.parametrize("fn", SAVES.values(), ids=SAVES.keys())
def test_recomputed_values_released_after_each_pass(fn, retain_graph):
    """After a backward pass, live bytes return to what the forward left, pass after pass."""
    x = _vector()
    with memory.track() as mem:
        y = remat(fn)(x)
        after_forward = mem.live
        for _ in range(2 if retain_graph else 1):
            (g,) = torch.autograd.grad(y.sum(), x, retain_graph=retain_graph)
            del g
            gc.collect()
            assert mem.live == after_forward
    assert after_forward == _nbytes(y)


def test_grad_inputs_subset_releases_values_it_did_not_unpack():
    """``autograd.grad(inputs=...)`` on a subset is right and drops the unused values."""

    def fn(x, w):
        return x.sin().cos() + w.cos().sin()

    x, w = _vector(0), _vector(1)
    with memory.track() as mem:
        y = remat(fn)(x, w)
        after_forward = mem.live
        (gx,) = torch.autograd.grad(y.sum(), inputs=[x], retain_graph=True)
        (expected,) = torch.autograd.grad(fn(x, w).sum(), inputs=[x])
        assert torch.equal(gx, expected)
        del gx, expected
        gc.collect()
        assert mem.live == after_forward
        (gw,) = torch.autograd.grad(y.sum(), inputs=[w])
        assert torch.equal(gw, torch.autograd.grad(fn(x, w).sum(), inputs=[w])[0])


INPLACE = {
    "with-intermediates": lambda x, params: (x * params["w"]).sin(),
    "inputs-only": lambda x, params: x * params["w"],
}


@pytest.mark.parametrize("fn", INPLACE.values(), ids=INPLACE.keys())
@pytest.mark.parametrize(
    ("mutate", "name"),
    [
        (lambda x, params: x.add_(1), "`x`"),
        (lambda x, params: params["w"].mul_(2), "`params['w']`"),
    ],
    ids=["positional", "nested-keyword"],
)
def test_input_modified_in_place_raises_naming_it(fn, mutate, name):
    """An input modified in place between forward and backward raises, naming the argument."""

    def region(x, params):
        return fn(x, params)

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    params = {"w": torch.randn(5, dtype=torch.float64, requires_grad=True)}
    y = remat(region)(x, params=params)
    with torch.no_grad():
        mutate(x, params)
    with pytest.raises(RuntimeError, match=re.escape(f"argument {name} was modified in place")):
        y.sum().backward()


_LAZY_VIEWS = {
    "conj": (lambda z: (z.sin() * z.conj()).real.sum(), torch.complex128),
    "conj-mm": (lambda z: ((z @ z.sin()) * z.conj()).real.sum(), torch.complex128),
    "neg": (lambda x: (x.sin() * torch._neg_view(x)).sum(), torch.float64),
}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize(("fn", "dtype"), _LAZY_VIEWS.values(), ids=_LAZY_VIEWS.keys())
@pytest.mark.parametrize("transform", ["eager", "grad"])
def test_a_conjugate_or_negative_view_of_an_input_is_not_the_input(fn, dtype, policy, transform):
    """``z.conj()`` shares ``z``'s memory, shape and strides, and reads it conjugated: the
    per-op policies took one for the other where both were saved (gradients off by up to
    2.7, no error)."""
    z = torch.linspace(-1, 1, 9, dtype=torch.float64).view(3, 3).to(dtype)
    if dtype.is_complex:
        z = z + 1j * torch.linspace(2, -1, 9, dtype=torch.float64).view(3, 3)

    def grads(f):
        if transform == "grad":
            return torch.func.grad(f)(z)
        x = z.clone().requires_grad_()
        f(x).backward()
        return x.grad

    assert torch.equal(grads(remat(fn, policy=policy)), grads(fn))


_GLOBAL = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4)


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize(
    ("replaced", "name"),
    [
        ("x", "argument `x`"),
        ("k", "argument `k`"),
        ("closure", "a tensor `fn` reaches by reference"),
        ("global", "a tensor `fn` reaches by reference"),
        ("same memory", None),
    ],
)
def test_data_replaced_between_forward_and_backward_raises_naming_it(policy, replaced, name):
    """``.data`` assigned between the forward and the backward gives a tensor other memory
    with no version bump: the recompute would read the new values, where plain autograd's
    saved intermediates hold the forward's (remat's gradients differed from plain's, with no
    error). A region that recomputes raises, naming the tensor; one that recomputes nothing
    (`save_everything`) gives plain's. A ``.data`` that keeps the memory changes nothing."""
    closure = torch.linspace(-2, 2, 16, dtype=torch.float64).view(4, 4)

    def fn(x, k):
        return ((x @ closure).tanh() @ k).sin() @ _GLOBAL

    def grads(wrap):
        x = torch.linspace(-1, 2, 12, dtype=torch.float64).view(3, 4).requires_grad_()
        k = torch.linspace(1, -1, 16, dtype=torch.float64).view(4, 4)
        out = wrap(fn)(x, k).sum()
        tensor = {"x": x, "k": k, "closure": closure}.get(replaced, _GLOBAL)
        original = tensor.data
        tensor.data = tensor.data.view(tensor.shape) if replaced == "same memory" else original * 2
        try:
            return torch.autograd.grad(out, x)[0]
        finally:
            tensor.data = original

    plain = grads(lambda f: f)
    if name is None or policy == "save_everything":
        assert torch.equal(grads(lambda f: remat(f, policy=policy)), plain)
        return
    with pytest.raises(RuntimeError, match=re.escape(f"{name}") + ".* had its `.data` replaced"):
        grads(lambda f: remat(f, policy=policy))


@pytest.mark.parametrize(
    ("forward_autocast", "backward_autocast"),
    [(True, False), (False, True), (True, True)],
    ids=["forward-only", "backward-only", "both"],
)
def test_autocast_state_is_replayed(forward_autocast, backward_autocast):
    """The recompute runs under the forward's autocast state, whatever backward runs under."""

    def fn(a, b):
        return ((a @ b).sin() @ b).cos()

    def run(f):
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(8, 16, generator=gen, requires_grad=True)
        b = torch.randn(16, 16, generator=gen, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=forward_autocast):
            y = f(a, b)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward_autocast):
            grads = torch.autograd.grad(y.float().square().sum(), (a, b))
        return y, grads

    (y, grads), (y_plain, grads_plain) = run(remat(fn)), run(fn)
    assert y.dtype == (torch.bfloat16 if forward_autocast else torch.float32)
    assert torch.equal(y, y_plain)
    for g, g_plain in zip(grads, grads_plain, strict=True):
        assert torch.equal(g, g_plain)


def _nested(calls):
    @remat
    def inner(h):
        calls["inner"] += 1
        return h.tanh().sigmoid()

    @remat
    def outer(x):
        calls["outer"] += 1
        return inner(x.exp()).log()

    return outer


def test_nested_remat_recompute_counts_and_grads():
    """Per pass: outer re-runs once, inner once inside it and once for its values; same grads."""
    # inner runs 3 times in all: forward, inside the outer's recompute, its own recompute.
    calls = collections.Counter()
    outer = _nested(calls)
    x = _vector()
    y = outer(x)
    assert calls == {"outer": 1, "inner": 1}
    with OpCounter() as backward:
        y.sum().backward()
    assert calls == {"outer": 2, "inner": 3}
    assert backward.counts["aten.exp"] == 1
    assert backward.counts["aten.tanh"] == 2
    assert backward.counts["aten.log"] == 0
    plain = _vector()
    plain.exp().tanh().sigmoid().log().sum().backward()
    assert torch.equal(x.grad, plain.grad)


def _grad_of_own_input(h):
    k = h.sin() @ h.t()
    return (torch.autograd.grad(k.sum(), [h], create_graph=True)[0] + k).cos()


@pytest.mark.parametrize("outer", POLICIES.values(), ids=POLICIES.keys())
def test_nested_region_taking_the_grad_of_its_own_input(outer):
    """A nested region whose ``fn`` calls ``autograd.grad(create_graph=True)`` on its own
    input, which it handed to the region around it: its recompute gets the input back as
    a leaf, which autograd saves again where the forward's had the input's producer (it
    raised "diverged" before). Plain's gradients over two steps."""
    inner = remat(_grad_of_own_input)
    x = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4).requires_grad_()
    expected = torch.autograd.grad(_grad_of_own_input(x.exp()).sum(), x)[0]
    nested = remat(lambda x: inner(x.exp()).sum(), policy=outer)
    for _ in range(2):
        assert torch.equal(torch.autograd.grad(nested(x), x)[0], expected)


def test_nested_remat_outer_region_holds_only_its_inputs():
    """An outer region holds no intermediates, not even the inner region's inputs."""
    outer = _nested(collections.Counter())
    x = _vector()
    with memory.track() as mem:
        y = outer(x)
        held = mem.live
    with memory.track() as mem:
        y_checkpoint = checkpoint(
            lambda x: checkpoint(lambda h: h.tanh().sigmoid(), x.exp(), use_reentrant=False).log(),
            x,
            use_reentrant=False,
        )
        held_checkpoint = mem.live
    assert held_checkpoint == _nbytes(y_checkpoint)
    assert held == _nbytes(y)


def test_no_leak_after_backward(regions):
    """After backward, every intermediate (forward or recompute) and the Region are freed."""
    refs = []

    def fn(x):
        a = x.sin()
        refs.append(weakref.ref(a))
        b = a.exp()
        refs.append(weakref.ref(b))
        return b.tanh()

    x = _vector()
    y = remat(fn)(x)
    y.sum().backward()
    del y
    gc.collect()
    assert len(refs) == 4
    assert len(regions) == 1
    assert [r() for r in refs] == [None] * 4
    assert regions[0]() is None


class _Hooked(nn.Module):
    """A submodule with a forward hook bound to its model: it refers back to the model."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4).double()
        self.linear = nn.Linear(4, 4).double()
        self.linear.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out.tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.first(x)).sin()


@pytest.mark.parametrize("model", ["sequential", "hooked"])
@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls", "memory_budget"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_model_let_go_of_is_freed(model, policy, backward):
    """remat's caches of the module trees a region reaches held every module (and so its
    parameters) strongly, up to 1,024 sets: a model made again and again (a sweep, a
    notebook cell run again) stayed alive, memory and all; then still where a submodule
    refers back to its model, and a submodule replaced until the next call."""
    resolved = remat_policies.memory_budget(0.5) if policy == "memory_budget" else policy

    def let_go() -> list[weakref.ref[Any]]:
        made: nn.Module = (
            _Hooked()
            if model == "hooked"
            else nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
        )
        region = remat(made, policy=resolved)
        out = region(_vector(n=8).view(2, 4))
        if backward:
            out.sum().backward()
        first = next(iter(made.children()))
        made.add_module(next(iter(made._modules)), nn.Identity())  # replaced
        refs = [weakref.ref(made), weakref.ref(first), weakref.ref(first.weight)]
        del first, out
        gc.collect()
        assert refs[1]() is None  # (before the next call)
        region(_vector(n=8).view(2, 4))
        return refs

    refs = let_go() + let_go()
    gc.collect()
    assert [r() for r in refs] == [None] * 6


_MASK = torch.ones(6, 6, dtype=torch.bool).tril()


def _attention(x, w):
    # As in the reference GPT: a masked softmax, and a projection whose output backward
    # does not need (dropout saves its mask): the recompute skips it under per-op policies.
    scores = (x @ w) @ x.transpose(-2, -1)
    scores = scores.masked_fill(~_MASK[: x.shape[-2], : x.shape[-2]], float("-inf"))
    y = scores.softmax(-1) @ x
    return x + F.dropout(F.linear(y, w, w[0]), 0.1)


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls", "save_matmuls_no_batch"])
def test_no_leak_after_backward_under_every_policy(regions, policy):
    """Regions of a masked attention block are freed after backward and a collection."""
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    with memory.track() as mem:
        for _ in range(3):
            remat(_attention, policy=policy)(x, w).square().sum().backward()
        gc.collect()
        assert mem.live == _nbytes(x.grad) + _nbytes(w.grad)
    assert len(regions) == 3
    assert [r() for r in regions] == [None] * 3


def _raises_after_a_product(x, w):
    h = (x @ w).tanh()
    if h.sum() > -1e9:
        raise ValueError("a check of the user's")
    return h


@pytest.mark.parametrize("way", ["fn raises", "nested"])
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_region_whose_forward_ends_in_an_error_is_freed(regions, policy, way):
    """A forward that ends in an error kept values whose histories hold the region (through
    autograd's hooks, a cycle no collector sees): it stayed alive for good, with them. So
    did a region nested in another under `offload`: its forward in the outer recompute
    kept a skipped value, and ended in an error there, which the outer recompute recovers
    from by running again."""
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        if way == "fn raises":
            with pytest.raises(ValueError, match="a check of the user's"):
                remat(_raises_after_a_product, policy=policy)(x, w)
        else:
            inner = remat(_attention, policy=policy)
            outer = remat(lambda x, w: inner(inner(x, w), w).tanh(), policy=policy)  # noqa: B023
            outer(x, w).sum().backward()
            del inner, outer
    gc.collect()
    assert [r() for r in regions] == [None] * len(regions)


def _step_without_collector(way: str, policy: Any, model: nn.Module) -> None:
    """One step through a region, run the ``way`` a user runs one (``model``: under
    `remat.apply`)."""
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    if way == "torch.func.grad":
        torch.func.grad(lambda w: remat(_attention, policy=policy)(x, w).square().sum())(w)
        return
    if way == "remat.apply":
        model(x).square().sum().backward()
        return
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    if way == "another thread alive":  # (remat's dispatch mode then runs every forward)
        other.start()
    try:
        remat(_attention, policy=policy)(x, w).square().sum().backward()
    finally:
        stop.set()
        if other.is_alive():
            other.join()


@pytest.mark.parametrize(
    "way", ["function", "remat.apply", "torch.func.grad", "another thread alive"]
)
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_step_is_freed_without_the_garbage_collector(regions, policy, way):
    """Once a step ends, reference counting alone frees its regions and all they held.

    remat's dispatch mode held itself (a bound method of its own in an attribute): each
    forward and recompute under it, with its records, the region's inputs and its random
    states, waited for Python's cyclic collector, steps later, and made its passes slow.
    """
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Tanh(), nn.Linear(4, 4))
    remat_apply(model.double(), nn.Sequential, policy=policy)
    model.requires_grad_(False)  # (its parameters and their gradients stay: not the step's)
    with memory.track():  # (torch's imports on their first use leave cycles: not the step's)
        _step_without_collector(way, policy, model)
    gc.collect()
    earlier = len(regions)
    gc.disable()
    try:
        with memory.track() as mem:
            _step_without_collector(way, policy, model)
            left = mem.live
        alive = [r() for r in regions[earlier:]]
    finally:
        gc.enable()
    assert alive == [None] * (len(regions) - earlier)
    assert left == 0


def _train(layers, model, steps):
    """Live bytes after each of ``steps`` SGD steps, measured across the whole loop."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    lives = []
    with memory.track() as mem:
        for _ in range(steps):
            h = x
            for layer in layers:
                h = layer(h)
            h.square().mean().backward()
            opt.step()
            opt.zero_grad()
            del h
            gc.collect()
            lives.append(mem.live)
    return lives


def test_training_steps_keep_live_bytes_stable():
    """Repeated training steps through remat'd layers hold the same bytes each step as plain."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(3)]
    )
    plain = _train(list(model), model, steps=4)
    lives = _train([remat(layer) for layer in model], model, steps=4)
    assert lives == plain
    assert len(set(lives)) == 1


def _thread_fn(x, w, gen):
    noise = torch.rand(x.shape[0], w.shape[1], generator=gen)
    return ((x @ w).tanh() * noise).sin() @ w


def _thread_job(seed, fn, results, barrier=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(16, 16, generator=gen, dtype=torch.float64).requires_grad_()
    if barrier is not None:
        barrier.wait()
    for _ in range(10):
        x.grad = w.grad = None
        fn(x, w, gen).square().sum().backward()
    results[seed] = (x.grad, w.grad, gen.get_state())


def test_concurrent_threads_match_sequential_plain():
    """Four threads running remat regions at once get the grads of sequential plain runs."""
    expected, got = {}, {}
    for seed in range(4):
        _thread_job(seed, _thread_fn, expected)
    barrier = threading.Barrier(4)
    wrapped = remat(_thread_fn)
    threads = [
        threading.Thread(target=_thread_job, args=(seed, wrapped, got, barrier))
        for seed in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(4))
    for seed in range(4):
        for a, b in zip(got[seed], expected[seed], strict=True):
            assert torch.equal(a, b)


class _Layer(nn.Module):
    def __init__(self, activation, residual):
        super().__init__()
        self.up = nn.Linear(64, 256, dtype=torch.float64)
        self.down = nn.Linear(256, 64, dtype=torch.float64)
        self.activation = activation
        self.residual = residual

    def forward(self, x):
        h = self.down(self.activation(self.up(x)))
        return x + h if self.residual else h


def _checkpointed(layer):
    return lambda x: checkpoint(layer, x, use_reentrant=False)


def _held_after_forward(layers, x):
    with memory.track() as mem:
        h = x
        for layer in layers:
            h = layer(h)
        held = mem.live
    h.sum().backward()
    return held


@pytest.mark.parametrize("residual", [False, True], ids=["plain-stack", "residual"])
@pytest.mark.parametrize("activation", [F.relu, F.gelu], ids=["relu", "gelu"])
def test_memory_held_after_forward_mlp_stack(activation, residual):
    """An 8-layer MLP with every layer remat'd holds <= 0.2x plain and <= torch checkpoint."""
    torch.manual_seed(0)
    layers = [_Layer(activation, residual) for _ in range(8)]
    x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    plain = _held_after_forward(layers, x)
    torch_checkpoint = _held_after_forward([_checkpointed(layer) for layer in layers], x)
    held = _held_after_forward([remat(layer) for layer in layers], x)
    print(
        f"\n{activation.__name__} residual={residual}: plain {plain} B, "
        f"torch checkpoint {torch_checkpoint} B, remat {held} B ({held / plain:.3f}x plain)"
    )
    assert held * 5 <= plain
    assert held <= torch_checkpoint


def test_dropout_rng_matches_plain():
    """Dropout: plain's outputs, grads, numbers drawn before backward and final RNG state."""

    def fn(x, w):
        return F.dropout((x @ w).tanh(), p=0.5, training=True) @ w

    def run(f):
        torch.manual_seed(0)
        x = torch.randn(8, 16, requires_grad=True)
        w = torch.randn(16, 16, requires_grad=True)
        y = f(x, w)
        between = torch.rand(5)
        y.square().sum().backward()
        return y, x.grad, w.grad, between, torch.get_rng_state()

    for got, expected in zip(run(remat(fn)), run(fn), strict=True):
        assert torch.equal(got, expected)


def test_backward_peak_equals_torch_checkpoint():
    """Forward and backward peaks match torch.utils.checkpoint's on an 8-layer MLP stack."""
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(64, 256, generator=gen), torch.randn(256, 64, generator=gen)) for _ in range(8)
    ]
    for w1, w2 in weights:
        w1.requires_grad_()
        w2.requires_grad_()

    def layer(x, w1, w2):
        return x + F.gelu(x @ w1) @ w2

    def peaks(wrap):
        x = torch.randn(32, 64, generator=gen, requires_grad=True)
        with memory.track() as mem:
            y = x
            for w1, w2 in weights:
                y = wrap(y, w1, w2)
            forward = mem.peak
            mem.reset_peak()
            y.square().sum().backward()
        for w1, w2 in weights:
            w1.grad = w2.grad = None
        return forward, mem.peak

    reference = peaks(lambda *a: checkpoint(layer, *a, use_reentrant=False))
    assert peaks(remat(layer)) == reference


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_reshape_decomposition_matches_between_forward_and_recompute(dropout, policy):
    """A transposed batched matmul (``reshape`` inside) recomputes exactly with every setup.

    Under a Python dispatch mode ``reshape`` runs as ``view`` instead of ``_reshape_alias``:
    forward and recompute must run under the same dispatch setup.
    """
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 4, 8, generator=gen, requires_grad=True)

    def attention(q, k):
        return F.dropout(torch.softmax(q @ k.transpose(1, 2), -1), dropout)

    torch.manual_seed(0)
    expected = torch.autograd.grad(attention(q, k).sum(), (q, k))
    torch.manual_seed(0)
    actual = torch.autograd.grad(remat(attention, policy=policy)(q, k).sum(), (q, k))
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


def test_an_input_let_go_of_after_a_freeing_pass_is_never_substituted():
    """Under compiled autograd a pass that frees the graph lets remat drop kept inputs
    and hold region inputs weakly. Read again, a dead one raises, a changed one too."""
    t = torch.ones(3)
    weak = _engine._Weak(t, t._version, t.untyped_storage()._cdata)
    assert weak.get() is t
    t.add_(1)
    with pytest.raises(RuntimeError, match="modified in place between the forward"):
        weak.get()
    weak = _engine._Weak(t, t._version, t.untyped_storage()._cdata)
    t.data = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"an argument had its `.data` replaced"):
        weak.get()
    del t
    gc.collect()
    with pytest.raises(RecomputeError, match="retain_graph=True"):
        weak.get()

"""RNG: the recompute replays every random op bit for bit, without touching the caller's RNG.

The corpus of random functions runs on each device of `DEVICES`: on CUDA its factories and
explicit generators are CUDA ones, and the default CUDA generator's state is compared too.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import threading
from pathlib import Path

import pytest
import torch
from torch.func import grad, vmap
from torch.utils.checkpoint import checkpoint
from tqdm import _monitor as tqdm_monitor

from remat import RecomputeError, policies, remat
from remat import _engine as remat_engine
from tests.helpers import POLICIES as EVERY_POLICY
from tests.helpers import (
    another_thread_alive,
    each_device,
    global_rng_states,
    inductor_pool_alive,
    run_alone,
    states_a_recompute_sees,
    step_with_idle_thread,
)

F = torch.nn.functional
GEN_A = torch.Generator().manual_seed(11)
GEN_B = torch.Generator().manual_seed(22)
# On CUDA the corpus draws from these instead; each function names both pairs, as globals,
# where remat sees generators (docs/rng.md#which-generators).
CUDA_A, CUDA_B = (
    (torch.Generator("cuda"), torch.Generator("cuda"))
    if torch.cuda.is_available()
    else (None, None)
)


def _generators(device):
    """The two explicit generators on ``device`` ("cpu" or "cuda")."""
    return (CUDA_A, CUDA_B) if device == "cuda" else (GEN_A, GEN_B)


def _dropout(x):
    return F.dropout(x.sin(), 0.5).exp()


def _bernoulli(x):
    return x.exp() * torch.bernoulli(torch.full_like(x, 0.3))


def _rand(x):
    return (x * torch.rand(x.shape, dtype=x.dtype, device=x.device)).sin()


def _randn_like(x):
    return (x + torch.randn_like(x)).tanh().square()


def _rand_like(x):
    return x.sin() * torch.rand_like(x)


def _rand_like_of_a_skipped_value(x):
    # Under a per-op policy nothing saves x.neg(): the recompute skips it, and rand_like
    # reads only its layout.
    return (torch.rand_like(x.neg()) + 1) * x


def _kept_rand_like_then_another_draw(x):
    # A policy may keep rand_like's output (it is decided like other ops): the recompute
    # must still leave its draw out (or make it), so that rand draws the forward's numbers.
    return (x * torch.rand_like(x)).sin() * torch.rand(x.shape, dtype=x.dtype, device=x.device)


def _skipped_rand_like_then_another_draw(x):
    # Keeping the sum spares rand_like: the recompute skips it, and rand draws after it.
    noise = torch.rand_like(x.neg()) + 1
    return (noise * x).sin() * torch.rand(x.shape, dtype=x.dtype, device=x.device)


def _rand_on_a_skipped_values_device(x):
    return (torch.rand(x.shape, dtype=x.dtype, device=x.neg().device) + 1) * x


def _randint(x):
    return x.cos() * torch.randint(0, 5, x.shape, dtype=x.dtype, device=x.device)


def _randint_like(x):
    return x.cos() * torch.randint_like(x, 7)


def _normal_(x):
    return x.exp() * torch.empty_like(x).normal_()


def _uniform_(x):
    return x.tanh() * torch.empty_like(x).uniform_(-1, 1)


def _randperm(x):
    return x.sin()[..., torch.randperm(x.shape[-1], device=x.device)].exp()


def _multinomial(x):
    weights = torch.ones(x.shape[-1], device=x.device)
    idx = torch.multinomial(weights, x.shape[-1], replacement=True)
    return x.sin()[..., idx].exp()


def _explicit_generator(x):
    gen_a = CUDA_A if x.is_cuda else GEN_A
    return x.sin() * torch.rand(x.shape, dtype=x.dtype, device=x.device, generator=gen_a)


def _two_generators(x):
    gen_a, gen_b = (CUDA_A, CUDA_B) if x.is_cuda else (GEN_A, GEN_B)
    a = torch.rand(x.shape, dtype=x.dtype, device=x.device, generator=gen_a)
    b = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=gen_b)
    return (x * a).exp() + (x * b).sin() * torch.rand_like(x)


RANDOM_FUNCTIONS = [
    _dropout,
    _bernoulli,
    _rand,
    _randn_like,
    _rand_like,
    _rand_like_of_a_skipped_value,
    _kept_rand_like_then_another_draw,
    _skipped_rand_like_then_another_draw,
    _rand_on_a_skipped_values_device,
    _randint,
    _randint_like,
    _normal_,
    _uniform_,
    _randperm,
    _multinomial,
    _explicit_generator,
    _two_generators,
]
IDS = [f.__name__.strip("_") for f in RANDOM_FUNCTIONS]


def _states(device="cpu"):
    return [*global_rng_states(), *(g.get_state() for g in _generators(device))]


def _seed(seed=0, device="cpu"):
    torch.manual_seed(seed)
    gen_a, gen_b = _generators(device)
    gen_a.manual_seed(seed + 1)
    gen_b.manual_seed(seed + 2)


def _eager_run(f, device="cpu"):
    """Forward, draw between forward and backward, backward; report everything observable."""
    _seed(device=device)
    x = torch.randn(4, 6, dtype=torch.float64, device=device, requires_grad=True)
    out = f(x)
    gen_a, gen_b = _generators(x.device.type)
    between = (
        torch.rand(3, device=device),
        torch.rand(2, device=device, generator=gen_a),
        torch.randn(2, device=device, generator=gen_b),
    )
    out.sum().backward()
    return out.detach(), x.grad, between, _states(device)


def _assert_same(a, b):
    for p, q in zip(a, b, strict=True):
        if isinstance(p, (tuple, list)):
            _assert_same(p, q)
        else:
            assert torch.equal(p, q)


# save_ops keeps what random ops made (rand_like's output, the sum after it), so the
# recompute does not run them; memory_budget chooses what to keep.
@pytest.mark.parametrize(
    "policy",
    [
        "save_nothing",
        "save_matmuls",
        "save_everything",
        policies.save_ops(torch.ops.aten.rand_like, torch.ops.aten.add),
        policies.memory_budget(0.5),
    ],
    # (a frozenset's repr has its own order in each process: test ids must not)
    ids=["save_nothing", "save_matmuls", "save_everything", "save_ops", "memory_budget"],
)
@pytest.mark.parametrize("f", RANDOM_FUNCTIONS, ids=IDS)
@each_device
def test_eager_random_ops_replay_bitwise(device, f, policy):
    """Outputs, grads, numbers drawn between forward and backward, final states: as plain."""
    _assert_same(_eager_run(f, device), _eager_run(remat(f, policy=policy), device))


@pytest.mark.parametrize("f", RANDOM_FUNCTIONS, ids=IDS)
@each_device
def test_forward_alone_advances_rng_like_plain(device, f):
    """A forward without backward leaves every generator where plain autograd leaves it."""
    x = torch.randn(4, 6, dtype=torch.float64, device=device, requires_grad=True)
    _seed(device=device)
    f(x)
    plain = _states(device)
    _seed(device=device)
    remat(f)(x)
    _assert_same(plain, _states(device))


@pytest.mark.parametrize("f", RANDOM_FUNCTIONS, ids=IDS)
@each_device
def test_recompute_happens_and_uses_forward_numbers(device, f):
    """The region really is recomputed, and the recompute sees the forward's random numbers."""
    calls = []

    def counted(x):
        calls.append(1)
        return f(x)

    _assert_same(_eager_run(f, device), _eager_run(remat(counted), device))
    assert len(calls) == 2


@pytest.mark.parametrize("threads", ["alone", "another_thread_alive"])
@each_device
def test_nested_regions_replay_bitwise(device, threads):
    """Random ops in nested regions replay exactly, at every level, with or without threads."""

    def inner(x):
        return F.dropout(x.exp(), 0.3) * torch.rand_like(x)

    def outer(region):
        def f(x):
            y = F.dropout(x.sin(), 0.4)
            return region(y).cos() * torch.randn_like(x)

        return f

    alive = another_thread_alive() if threads != "alone" else contextlib.nullcontext()
    with alive:
        expected = _eager_run(outer(inner), device)
        _assert_same(expected, _eager_run(remat(outer(remat(inner))), device))


def test_tqdm_monitor_thread_does_not_count_as_another_thread():
    """Any progress bar (torch.compile's) starts tqdm's monitor for the process's life;
    it only refreshes stalled bars, so regions need not capture per op for it."""
    from tqdm import tqdm

    from remat._rng import threaded

    for _ in tqdm(range(2), disable=False, file=io.StringIO(), mininterval=0):
        pass
    assert any(isinstance(t, tqdm_monitor.TMonitor) for t in threading.enumerate())
    assert not threaded()
    with another_thread_alive():
        assert threaded()


def test_inductor_compile_threads_do_not_count_as_other_threads():
    """Once a compile with more than one thread made it, inductor's compile pool lives as
    long as the process; it never draws, so the default policy's recompute still lends the
    forward's state, without a dispatch mode (docs/rng.md, Threads)."""
    from remat._rng import threaded

    with inductor_pool_alive():
        assert not threaded()
        with another_thread_alive():  # a thread of the user's still counts
            assert threaded()
        forward, recompute, caller = states_a_recompute_sees("save_nothing")
    assert not torch.equal(forward, caller)
    assert torch.equal(recompute, forward)  # lent: the recompute drew from the forward's state


def test_a_jupyter_kernels_own_threads_do_not_count_as_other_threads():
    """A kernel's threads (channels, output streams, heartbeat, parent poller) run none of
    the user's cells: in a notebook, regions need not capture per op for them. A thread
    the notebook starts still counts."""
    import nbclient
    import nbformat

    cell = (
        "import threading\n"
        "from remat._rng import threaded\n"
        "print(threading.active_count() > 3, threaded())\n"
        "stop = threading.Event()\n"
        "mine = threading.Thread(target=stop.wait)\n"
        "mine.start()\n"
        "print(threaded())\n"
        "stop.set()\n"
        "mine.join()\n"
    )
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nbclient.NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(Path(__file__).resolve().parents[1])}},
    ).execute()
    assert notebook.cells[0].outputs[0]["text"] == "True False\nTrue\n"


@pytest.mark.parametrize("f", RANDOM_FUNCTIONS, ids=IDS)
@each_device
def test_under_torch_func_grad(device, f):
    """Under torch.func.grad, gradients and final generator states match plain."""

    def run(g):
        _seed(device=device)
        x = torch.randn(4, 6, dtype=torch.float64, device=device)
        return grad(lambda x: g(x).sum())(x), _states(device)

    _assert_same(run(f), run(remat(f)))


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize(
    "f", [_dropout, _rand_like, _normal_, _rand], ids=lambda f: f.__name__.strip("_")
)
@each_device
def test_vmap_grad_randomness_modes(device, f, randomness):
    """vmap(grad) with randomness="different" and "same" matches plain, states included."""

    def run(g):
        _seed(device=device)
        xs = torch.randn(3, 4, 6, dtype=torch.float64, device=device)
        return vmap(grad(lambda x: g(x).sum()), randomness=randomness)(xs), _states(device)

    _assert_same(run(f), run(remat(f)))


def test_autocast_with_random_ops():
    """Dropout under CPU autocast (bfloat16 matmul) replays exactly."""

    def f(x):
        return F.dropout(x @ x.T, 0.5).float().sin()

    def run(g):
        _seed()
        x = torch.randn(8, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = g(x)
        out.sum().backward()
        return out.detach(), x.grad, _states()

    _assert_same(run(f), run(remat(f)))


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_preserve_rng_false_captures_nothing(monkeypatch, policy):
    """With preserve_rng=False no generator state is read, with or without a dispatch mode."""
    import remat._rng as rng

    def forbidden(*args):
        raise AssertionError("captured")

    for method in ("call", "start", "finish"):
        monkeypatch.setattr(rng.RngCapture, method, forbidden)
    x = torch.randn(5, requires_grad=True)
    y = remat(lambda x: F.dropout(x.sin(), 0.5).exp(), policy=policy, preserve_rng=False)(x)
    y.sum().backward()
    assert x.grad is not None


def test_preserve_rng_false_recompute_draws_fresh_numbers():
    """Without RNG capture a dropout recompute draws new numbers (documented behaviour)."""
    torch.manual_seed(0)
    x = torch.ones(1000, dtype=torch.float64, requires_grad=True)
    (F.dropout(x, 0.5).exp()).sum().backward()
    plain = x.grad.clone()
    torch.manual_seed(0)
    x.grad = None
    remat(lambda x: F.dropout(x, 0.5).exp(), preserve_rng=False)(x).sum().backward()
    assert not torch.equal(plain, x.grad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_random_ops_replay_bitwise():
    """On CUDA, including generators first touched inside the region, replay is exact."""

    def run(g):
        torch.manual_seed(0)
        torch.cuda.manual_seed_all(0)
        x = torch.randn(4, 6, device="cuda", requires_grad=True)
        out = g(x)
        between = torch.rand(3, device="cuda")
        out.sum().backward()
        return out.detach(), x.grad, between, torch.cuda.get_rng_state()

    def on_cuda(x):
        cpu = torch.rand(x.shape).to(x.device)
        return F.dropout(x.sin(), 0.5) * torch.rand_like(x) + (x * cpu).exp()

    _assert_same(run(on_cuda), run(remat(on_cuda)))


class _Holder:
    """Not a module: remat cannot see the generators it keeps."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(5)


def _hidden_run(policy):
    holder = _Holder()

    def hidden(x):
        return (x * torch.rand(x.shape, dtype=x.dtype, generator=holder.gen)).sin()

    x = torch.ones(4, dtype=torch.float64, requires_grad=True)
    f = hidden if policy is None else remat(hidden, policy=policy)
    f(x).sum().backward()
    return x.grad, holder.gen.get_state()


def test_generator_remat_cannot_see_raises_instead_of_drawing_other_numbers():
    """Without a dispatch mode, a generator out of remat's sight makes the recompute raise."""
    with pytest.raises(RecomputeError, match="generator"):
        _hidden_run("save_nothing")


def test_without_the_generator_check_the_gradient_is_wrong_with_no_error(monkeypatch):
    """What the steady state's check of explicit generators is for (docs/rng.md#cost): a
    region's first call runs under remat's dispatch mode, which sees the draw; later calls
    have only the check, which raises. Without it, the recompute draws other numbers from a
    generator remat cannot see: the gradient and the generator's state differ from plain's
    with no error, as with torch's checkpoint."""
    holder = _Holder()

    def hidden(x):
        return (x * torch.rand(x.shape, dtype=x.dtype, generator=holder.gen)).sin()

    def run(f):
        holder.gen.manual_seed(5)
        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        f(x).sum().backward()
        return x.grad, holder.gen.get_state()

    region = remat(hidden)
    with pytest.raises(RecomputeError, match="that the forward did not draw from"):
        run(region)  # the first call: remat's dispatch mode
    with pytest.raises(RecomputeError, match="that the forward's capture did not see"):
        run(region)  # the steady state: the check
    expected = run(hidden)
    monkeypatch.setattr(remat_engine, "GeneratorWatch", lambda *_: contextlib.nullcontext())
    for got in (run(region), run(functools.partial(checkpoint, hidden, use_reentrant=False))):
        assert not torch.equal(got[0], expected[0])
        assert not torch.equal(got[1], expected[1])


def test_generator_in_a_container_of_a_closure_replays():
    """A generator held in a dict in a closure is seen, captured and replayed bitwise."""

    def run(wrap):
        generators = {"noise": torch.Generator().manual_seed(5)}

        def noisy(x):
            noise = torch.rand(x.shape, dtype=x.dtype, generator=generators["noise"])
            return (x * noise).sin()

        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        wrap(noisy)(x).sum().backward()
        return x.grad, generators["noise"].get_state()

    _assert_same(run(lambda f: f), run(remat))


def test_generator_out_of_sight_is_captured_under_a_per_op_policy():
    """Under a per-op policy's dispatch mode every generator a random op uses is captured."""
    _assert_same(_hidden_run(None), _hidden_run("save_matmuls"))


@pytest.mark.parametrize("alive", ["forward", "backward", "both"])
def test_other_threads_alive_switch_to_per_op_capture_bitwise(alive):
    """With an idle thread alive at the forward, the backward or both: plain's results."""

    def f(x):
        return F.dropout(x.sin(), 0.5).exp() * torch.rand_like(x)

    def run(g):
        torch.manual_seed(0)
        x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
        y = step_with_idle_thread(g, x, alive)
        return y.detach(), x.grad, _states()

    _assert_same(run(f), run(remat(f)))


def test_op_tagged_random_that_draws_nothing_with_a_thread_alive_at_backward():
    """SDPA without dropout is tagged random; a thread alive by the backward: plain's grads."""

    def attend(q):
        return F.scaled_dot_product_attention(q, q.cos(), q.sin(), is_causal=True).exp()

    def run(f):
        q = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
        y = f(q)
        stop = threading.Event()
        idle = threading.Thread(target=stop.wait)
        idle.start()
        try:
            y.sum().backward()
        finally:
            stop.set()
            idle.join()
        return y.detach(), q.grad, _states()

    torch.manual_seed(0)
    expected = run(attend)
    torch.manual_seed(0)
    _assert_same(run(remat(attend)), expected)


def test_nested_recomputes_replay_with_threads_started_or_stopped_between(tmp_path):
    """Regions in a region, one with random numbers and an ``autograd.grad`` inside
    (its recompute runs inside the forward and inside the outer recompute), and three
    levels with an ``autograd.grad`` at two: plain's outputs, gradients and generator
    state over two steps, under pairs of policies, with an idle thread alive at neither
    pass, the forward, the backward or both (found by `make fuzz`: a thread started by
    the backward gave another gradient). Run in a process of its own, as pytest's
    workers keep threads alive."""
    lines = run_alone(_NESTED_THREADS, tmp_path)
    assert len(lines) == 2 * 4 * 9, lines
    assert [line for line in lines if line.endswith("False")] == []
    raising = [line.split()[:4] for line in lines if line.endswith("raises")]
    per_op_outer = [
        ["three_levels", alive, outer, inner]
        for alive in ("neither", "forward", "backward", "both")
        for outer in ("save_matmuls", "save_all_but_names(names=frozenset({'h'}))")
        for inner in ("save_nothing", "save_matmuls", "save_all_but_names(names=frozenset({'h'}))")
    ]
    assert raising == per_op_outer, "docs/limitations.md says otherwise: update it, then this"


_NESTED_THREADS = """
import itertools
import torch
from remat import RecomputeError, policies, remat
from tests.helpers import step_with_idle_thread

w = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4).requires_grad_()


def first(h):
    return h.exp().exp()


def drawn(h):
    s = h.softmax(1)
    r = (torch.rand_like(s) + 1) * s
    k = r + w
    return sum(torch.autograd.grad(k.tanh().pow(3).sum(), [k, r])) * k


def last(h):
    return h.softmax(0) @ w.t()


def two_levels(wrap):
    blocks = [wrap(first, 1), wrap(drawn, 1), wrap(last, 1)]

    def f(x):
        h = (x @ x).exp()
        for block in blocks:
            h = block(h)
        return h

    return wrap(f, 0)


def three_levels(wrap):  # an autograd.grad in the outer region and in the middle one
    inner = wrap(lambda h: (h * torch.rand_like(h)).sin() @ w, 1)

    def middle(h):
        k = inner(h)
        return (torch.autograd.grad(k.sum(), [h], create_graph=True)[0] + k).cos()

    middle = wrap(middle, 0)

    def f(x):
        a = (x @ w).relu()
        c = middle(a)
        return torch.autograd.grad((c * c).sum(), [a], create_graph=True)[0] @ w + c

    return wrap(f, 0)


def run(f, alive):
    torch.manual_seed(989)
    x = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4).requires_grad_()
    results = []
    for _ in range(2):
        y = step_with_idle_thread(f, x, alive)
        results += [y.detach(), x.grad, w.grad, torch.get_rng_state()]
        x.grad = w.grad = None
    return results


kinds = ["save_nothing", "save_matmuls", policies.save_all_but_names("h")]
alive_at = ("neither", "forward", "backward", "both")
for program, alive in itertools.product((two_levels, three_levels), alive_at):
    expected = run(program(lambda fn, level: fn), alive)
    for pair in itertools.product(kinds, kinds):
        try:
            got = run(program(lambda fn, level: remat(fn, policy=pair[level])), alive)
        except RecomputeError:  # docs/limitations.md: three levels, an outer per-op policy
            print(program.__name__, alive, *pair, "raises")
            continue
        same = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        print(program.__name__, alive, *pair, same)
"""


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_generators_with_the_same_seed_and_state_are_told_apart(policy):
    """The default generator and an explicit one, both seeded 0, each drawn from once: the
    recompute under the dispatch mode (a region's first call, a thread alive at the
    backward) replays each on its own clone, not the first with that state."""

    def fn(x, g):
        return (x * torch.rand(4, 4, dtype=x.dtype)).sin() * (
            x * torch.rand(4, 4, generator=g, dtype=x.dtype)
        ).exp()

    def run(f):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        x = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4).requires_grad_()
        results = []
        for _ in range(3):
            y = step_with_idle_thread(lambda x: f(x, g), x, "backward")
            results += [y.detach(), x.grad, torch.get_rng_state(), g.get_state()]
            x.grad = None
        return results

    _assert_same(run(remat(fn, policy=policy)), run(fn))


def _dropout_pair(h):
    return torch.cat([h.tanh(), F.dropout(h, 0.3)], 0)


def _drawn_in_place(h):
    return (h * torch.empty_like(h).uniform_()).exp()


@pytest.mark.parametrize("inner", ["save_nothing", "save_matmuls", "save_all_but_names"])
@pytest.mark.parametrize("outer", ["save_nothing", "save_matmuls", "save_all_but_names"])
@pytest.mark.parametrize("kind", ["dropout_in_both", "grad_of_the_inner_output"])
def test_nested_regions_with_random_ops_in_both(kind, outer, inner):
    """A region inside a region, random ops in both (dropout, which draws with an in-place
    op on CPU, or an in-place ``uniform_``), and, in the second kind, an ``autograd.grad``
    in the outer region of the inner one's output: plain's results over two steps. A
    nested forward draws on a private generator, its recompute on none: the signatures
    leave the generator to the RNG replay (both raised under per-op policies before)."""
    kinds = {"save_all_but_names": policies.save_all_but_names("h")}

    def program(wrap):
        if kind == "dropout_in_both":
            region = wrap(_dropout_pair, inner)
            return wrap(lambda x: _dropout_pair(region(x.sin())) * torch.rand_like(x[:1]), outer)
        region = wrap(_drawn_in_place, inner)

        def f(x):
            h = (x @ x.t()).tanh()
            k = region(h)
            return torch.autograd.grad(k.sin().sum(), [h], create_graph=True)[0] + k

        return wrap(f, outer)

    def run(f):
        torch.manual_seed(0)
        x = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4).requires_grad_()
        results = []
        for _ in range(2):
            y = f(x)
            y.sum().backward()
            results += [y.detach(), x.grad, torch.get_rng_state()]
            x.grad = None
        return results

    expected = run(program(lambda fn, policy: fn))
    _assert_same(
        run(program(lambda fn, policy: remat(fn, policy=kinds.get(policy, policy)))), expected
    )


def _seeds_default(x, g):
    torch.manual_seed(5)
    return (x * torch.rand(4, 4, dtype=x.dtype)).sin()


def _seeds_argument(x, g):
    a = torch.rand(4, 4, generator=g, dtype=x.dtype)
    g.manual_seed(5)
    return (x * a).sin() * torch.rand(4, 4, generator=g, dtype=x.dtype)


def _sets_argument(x, g):
    g.set_state(torch.Generator().manual_seed(2).get_state())
    return (x * torch.rand(4, 4, generator=g, dtype=x.dtype)).sin()


def _makes_one(x, g):
    made = torch.Generator().manual_seed(7)
    a = torch.rand(4, 4, generator=made, dtype=x.dtype)
    return (x * a).sin() * torch.rand(4, 4, generator=made, dtype=x.dtype)


@pytest.mark.parametrize("alive", ["neither", "backward"])
@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
@pytest.mark.parametrize("f", [_seeds_default, _seeds_argument, _sets_argument, _makes_one])
def test_generators_seeded_or_made_inside_fn(f, policy, alive):
    """``fn`` seeds the default generator, seeds or sets one it is passed (also after
    drawing from it), or makes and seeds its own and draws twice: plain's outputs,
    gradients and generator states over 3 steps. A recompute on clones follows what
    ``fn`` set, and gives the caller's state back (before: other gradients or states)."""

    def run(fn):
        torch.manual_seed(1)
        g = torch.Generator().manual_seed(1)
        x = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4).requires_grad_()
        results = []
        for _ in range(3):
            y = step_with_idle_thread(lambda x: fn(x, g), x, alive)
            results += [y.detach(), x.grad, torch.get_rng_state(), g.get_state()]
            x.grad = None
        return results

    _assert_same(run(remat(f, policy=policy)), run(f))


class _BuiltOnFirstCall(torch.nn.Module):
    """Builds a layer on its first forward (drawing its initial weights), then dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "layer"):
            self.layer = torch.nn.Linear(4, 4).double()
        return F.dropout(self.layer(x).tanh(), 0.5)


@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_random_ops_the_recompute_leaves_out_raise(policy):
    """A forward that draws numbers its recompute does not (a layer built on the first
    call): the recompute's dropout would draw the layer's initial numbers. It raises,
    naming both ops (per-op policies gave other gradients with no error, as did the default
    policy's first call). Later calls, which build nothing, train as plain."""
    torch.manual_seed(0)
    model = _BuiltOnFirstCall()
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).view(3, 4).requires_grad_()
    if policy == "save_everything":  # nothing recomputed
        remat(model, policy=policy)(x).sum().backward()
    else:
        with pytest.raises(RecomputeError, match=r"aten\.uniform_\.default did"):
            remat(model, policy=policy)(x).sum().backward()
    plain = copy.deepcopy(model)
    for _ in range(2):
        grads = []
        for f in (plain, remat(model, policy=policy)):
            torch.manual_seed(1)
            x.grad = None
            f(x).sum().backward()
            grads.append(x.grad)
        assert torch.equal(*grads)

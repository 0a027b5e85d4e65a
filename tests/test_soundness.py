"""Soundness (issue 11): a remat region gives plain autograd's results bitwise, or says why not.

The oracle everywhere: the undecorated function under plain autograd, and ``remat(fn,
policy=p)`` on fresh copies of the same float64 inputs, on each device of `DEVICES`; outputs,
gradients of every leaf (inputs and module parameters) and module buffers are compared
bitwise. Where a divergence
cannot be repaired, a `RecomputeError` that names what diverged is also accepted.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import threading
import time

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from remat import RecomputeError, _modules, _provenance, name, policies, remat
from tests.helpers import POLICIES as EVERY_POLICY
from tests.helpers import assert_tree_equal, each_device, run_alone

aten = torch.ops.aten
DTYPE = torch.float64
NS = "remat-soundness"


def _keep_mm_sin(call):
    return call.op.overloadpacket in (aten.mm, aten.sin)


POLICIES = {
    "save_nothing": "save_nothing",
    "save_matmuls": "save_matmuls",
    "save_matmuls_no_batch": "save_matmuls_no_batch",
    "save_ops(mm,add)": policies.save_ops(aten.mm, aten.add),
    "custom(mm,sin)": _keep_mm_sin,
}
each_policy = pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())

# Open items of issue 11, documented in docs/limitations.md. Strict: each fails CI once fixed.


def _randn(seed, *shape, requires_grad=True, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen, dtype=DTYPE).to(device)
    return t.requires_grad_(requires_grad)


def _grads(tensors):
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def _equal_or_recompute_error(run_plain, run_remat, mentions="aten."):
    """``run_remat()`` equals ``run_plain()`` bitwise, or raises a RecomputeError that says why."""
    expected = run_plain()
    try:
        actual = run_remat()
    except RecomputeError as error:
        message = str(error)
    else:
        assert_tree_equal(actual, expected)
        return
    assert mentions in message, f"the error does not mention {mentions!r}: {message}"


# 1. A recompute that runs one extra op ----------------------------------------------------------


def _extra_op_on_second_call():
    calls = []

    def fn(x, w):
        calls.append(None)
        h = x * 1 if len(calls) == 2 else x
        return (h @ w).sin() @ w

    return fn


def _run_extra_op(wrap, device):
    x, w = _randn(0, 3, 3, device=device), _randn(1, 3, 3, device=device)
    out = wrap(_extra_op_on_second_call())(x, w)
    out.sin().sum().backward()
    return out, _grads([x, w])


@each_policy
@each_device
def test_extra_op_in_recompute_is_equal_or_named(device, policy):
    """A recompute that runs one extra harmless op before a kept matmul: equal, or names it."""
    _equal_or_recompute_error(
        lambda: _run_extra_op(lambda f: f, device),
        lambda: _run_extra_op(lambda f: remat(f, policy=policy), device),
    )


# 2. autograd.grad inside fn -------------------------------------------------------------------


def _inner_grad(create_graph):
    def fn(x, w):
        h = (x @ w).tanh()
        gh, gx = torch.autograd.grad(
            h.pow(3).sum(), (h, x), create_graph=create_graph, retain_graph=True
        )
        return ((gh + gx) * h) @ w

    return fn


@pytest.mark.parametrize("create_graph", [False, True], ids=["no_create_graph", "create_graph"])
@each_policy
@each_device
def test_inner_autograd_grad_matches_plain(device, policy, create_graph):
    """autograd.grad on fn's own intermediates inside fn, then the outer backward: plain's."""

    def run(wrap):
        x, w = _randn(0, 3, 3, device=device), _randn(1, 3, 3, device=device)
        out = wrap(_inner_grad(create_graph))(x, w)
        out.sin().sum().backward()
        return out, _grads([x, w])

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


# 3. Reads outside the aten op stream ----------------------------------------------------------


def _branch_on_tolist(x, w):
    v = (x + 1).tolist()[0][0]
    y = x.sin() if v > 0 else x.cos()
    return (y * v).tanh() @ w


def _moe_split(x, w, idx, experts):
    h = (x @ w).tanh()
    sizes = torch.bincount(idx, minlength=experts.shape[0]).tolist()
    chunks = h.split(sizes)
    return torch.cat([chunk @ experts[e] for e, chunk in enumerate(chunks)]).sin()


def _item(x, w):
    s = (x + 1).sum().item()
    return (x.sin() * s).tanh() @ w


def _numpy(x, w):
    t = (x + 1).detach()
    v = float((t.cpu() if t.is_cuda else t).numpy()[0, 0])
    y = x.sin() if v > 0 else x.cos()
    return (y * v).tanh() @ w


def _from_numpy(x, w):
    h = x.sin()
    back = torch.from_numpy((h.detach().cpu() if h.is_cuda else h.detach()).numpy())
    return (h * back.to(h.device)).tanh() @ w  # mul saves it


def _as_tensor(x, w):
    h = x.sin()
    back = torch.as_tensor(h.tolist(), dtype=h.dtype, device=h.device)
    return (h + back).tanh() @ w  # add saves nothing: the tensor is read by a replayed op


def _run_reads(fn, wrap, device):
    x, w = _randn(0, 6, 4, device=device), _randn(1, 4, 4, device=device)
    with torch.no_grad():
        x[0, 0] = 0.75  # (x + 1)[0, 0] > 0: the sin branch
    args, leaves = (x, w), [x, w]
    if fn is _moe_split:
        experts = _randn(2, 3, 4, 4, device=device)
        idx = torch.tensor([2, 0, 2, 1, 2, 0], device=device)
        args, leaves = (x, w, idx, experts), [x, w, experts]
    out = wrap(fn)(*args)
    out.sin().sum().backward()
    return out, _grads(leaves)


READS = {
    "tolist_branch": _branch_on_tolist,
    "moe_split": _moe_split,
    "item": _item,
    "numpy": _numpy,
    "from_numpy": _from_numpy,
    "as_tensor": _as_tensor,
}


@pytest.mark.parametrize("fn", READS.values(), ids=READS.keys())
@each_policy
@each_device
def test_python_reads_of_values_match_plain(device, policy, fn):
    """Values read by Python (tolist, bincount sizes, item, numpy) are recomputed, not skipped."""
    expected = _run_reads(fn, lambda f: f, device)
    assert_tree_equal(_run_reads(fn, lambda f: remat(f, policy=policy), device), expected)


@pytest.mark.parametrize("change", ["values", "in_place"])
@pytest.mark.parametrize("policy", list(POLICIES.values())[1:], ids=list(POLICIES)[1:])
def test_a_tensor_made_outside_aten_is_checked_against_its_twin(policy, change):
    """A per-op policy's recompute matches a tensor made outside aten (``from_numpy``) to the
    forward's by value: one that differs, or that the region modified after reading it (its
    value then is gone), is never taken for it."""
    calls = []

    def fn(x, w):
        calls.append(1)
        h = x.sin()
        back = torch.from_numpy(h.detach().numpy() + (len(calls) if change == "values" else 0))
        y = (h * back).tanh() @ w
        if change == "in_place":
            back.add_(1)
        return y

    x, w = _randn(0, 6, 4), _randn(1, 4, 4)
    out = remat(fn, policy=policy)(x, w)
    with pytest.raises(RecomputeError, match="never rebuilt"):
        out.sum().backward()


class _NumpySin(torch.autograd.Function):
    """Its output is made outside aten, and gets its ``requires_grad`` only as ``apply``
    returns it: the forward first reads it (``apply``'s own ops) before that."""

    @staticmethod
    def forward(ctx, a, saves):
        y = torch.from_numpy(np.sin(a.detach().numpy()))
        ctx.save_for_backward(*{"input": (a,), "output": (y,), "nothing": ()}[saves])
        ctx.saves = saves
        return y

    @staticmethod
    def backward(ctx, grad):
        if ctx.saves == "nothing":
            return grad, None
        (saved,) = ctx.saved_tensors
        cos = saved.cos() if ctx.saves == "input" else (1 - saved * saved).sqrt()
        return grad * cos, None


@pytest.mark.parametrize("saves", ["input", "output", "nothing"])
@each_policy
def test_an_autograd_function_through_numpy_matches_plain(policy, saves):
    def fn(x, w):
        return _NumpySin.apply((x @ w).tanh(), saves).exp() @ w

    def run(f):
        x, w = _randn(0, 6, 4), _randn(1, 4, 4)
        f(x, w).sin().sum().backward()
        return _grads([x, w])

    assert_tree_equal(run(remat(fn, policy=policy)), run(fn))


def _branch_on_a_skipped_value(then):
    """``fn`` branching on the ``.device`` of a value no backward needs (a statistic
    returned for logging), which a per-op policy's recompute skips: a ``meta`` placeholder."""

    def fn(x, w):
        stats = x.pow(2).mean(-1, keepdim=True)
        h = x @ w
        on_cpu = stats.device.type == "cpu"
        if then == "scale":
            h = h * (0.5 if on_cpu else 1.0)
        else:
            h = F.dropout(h, 0.3 if on_cpu else 0.6)
        return (h.tanh() @ w, stats)

    return fn


def _run_branch(f):
    x, w = _randn(0, 4, 6), _randn(1, 6, 6)
    torch.manual_seed(0)
    out, stats = f(x, w)
    out.sum().backward()
    return out, stats, _grads([x, w])


@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_a_branch_on_a_skipped_values_device_matches_plain(policy):
    """The other branch raised ("never rebuilt"). A recompute that skipped values and did
    not rebuild every value now runs again without skipping."""
    fn = _branch_on_a_skipped_value("scale")
    assert_tree_equal(_run_branch(remat(fn, policy=policy)), _run_branch(fn))


@pytest.mark.parametrize("fraction", [0.5, 0.7])
def test_an_op_that_did_not_match_never_writes_a_kept_value(fraction):
    """``memory_budget`` keeps the dropout mask, a chain (``empty_like``, ``bernoulli_``,
    ``div_``) whose first op the recompute lends the kept memory. The other branch's dropout
    (another ``p``) did not match, and drew into it; the run after it, without skipping,
    read the overwritten mask: other gradients, with no error. It now runs again before
    such a write, without lending kept memory."""
    fn = _branch_on_a_skipped_value("dropout")
    got = _run_branch(remat(fn, policy=policies.memory_budget(fraction)))
    assert_tree_equal(got, _run_branch(fn))


@each_device
def test_device_of_a_skipped_value_does_not_restart_the_recompute(device):
    """A skipped value is a meta placeholder: a factory call on its ``.device`` runs on the
    forward's device when that matches the forward's op, instead of restarting."""
    calls = []

    def fn(x, w):
        calls.append(1)
        y = x @ w  # kept
        unused = y.cos()  # skipped: only its device is read
        scale = torch.full((), 2.0, dtype=y.dtype, device=unused.device)
        return (y * scale).sin()

    x, w = _randn(0, 4, 4, device=device), _randn(1, 4, 4, device=device)
    expected = torch.autograd.grad(fn(x, w).sum(), (x, w))
    calls.clear()
    got = torch.autograd.grad(remat(fn, policy="save_matmuls")(x, w).sum(), (x, w))
    assert_tree_equal(got, expected)
    assert len(calls) == 2  # the forward and one recompute, not a restart


# 4. A mask built on the first call and cached on the module -----------------------------------


class _CachedMaskAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.mask = None

    def forward(self, x):
        t = x.shape[0]
        if self.mask is None:
            self.mask = torch.ones(t, t, dtype=x.dtype, device=x.device).tril().bool()
        scores = self.q(x) @ self.k(x).t()
        scores = scores.masked_fill(~self.mask, float("-inf")).softmax(-1)
        return scores @ self.v(x)


@each_policy
@each_device
def test_mask_cached_on_first_call_is_equal_or_named(device, policy):
    """A causal mask built only in the forward (T == d): plain's gradients, or names the op."""
    torch.manual_seed(0)
    model = _CachedMaskAttention(4).double().to(device)

    def run(wrap):
        m = copy.deepcopy(model)
        x = _randn(3, 4, 4, device=device)
        out = wrap(m)(x)
        out.sin().sum().backward()
        return out, _grads([x, *m.parameters()])

    _equal_or_recompute_error(
        lambda: run(lambda m: m), lambda: run(lambda m: remat(m, policy=policy))
    )


# 5. Module state: buffers updated in the forward ----------------------------------------------


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.bn, self.lin2 = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.lin2(self.bn(self.lin1(x)).tanh())


class _EMANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return torch.tanh(self.lin(x) + self.ema)


def _spectral_net():
    lin = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))
    return nn.Sequential(lin, nn.Tanh(), nn.Linear(4, 3))


MODELS = {"batch_norm": _BatchNormNet, "spectral_norm": _spectral_net, "ema_buffer": _EMANet}


def _train(model, forward, steps=3):
    """Forward, backward, SGD step; each step's output and gradients, then the state_dict."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history, device = [], next(model.parameters()).device
    for step in range(steps):
        x = _randn(10 + step, 5, 4, requires_grad=False, device=device)
        opt.zero_grad()
        out = forward(x)
        out.sin().sum().backward()
        history.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return history, {k: v.clone() for k, v in model.state_dict().items()}


def _evaluated_first(model, forward):
    """One step in eval mode (a sanity check before training), then training."""
    model.eval()
    with_eval = forward(
        _randn(9, 5, 4, requires_grad=False, device=next(model.parameters()).device)
    )
    model.train()
    return with_eval, _train(model, forward)


@pytest.mark.parametrize("run", [_train, _evaluated_first], ids=["train", "eval_then_train"])
@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
@each_policy
@each_device
def test_module_state_updated_in_forward_matches_plain(device, policy, make, run):
    """BatchNorm, spectral_norm, an EMA buffer: 3 training steps give plain's grads and state."""
    torch.manual_seed(0)
    model = make().double().to(device).train()
    plain, kept = copy.deepcopy(model), copy.deepcopy(model)
    expected = run(plain, plain)
    assert_tree_equal(run(kept, remat(kept, policy=policy)), expected)


def _functional_batch_norm(x, w, b, mean, var, w2):
    return F.batch_norm(x, mean, var, w, b, training=True).tanh() @ w2


@pytest.mark.parametrize("wrapper", ["once", "each_step"])
@each_policy
@each_device
def test_functional_batch_norm_updates_running_stats_once(device, policy, wrapper):
    """F.batch_norm with running buffers as arguments updates them once per step, as plain."""

    def run(wrap):
        f = wrap(_functional_batch_norm)
        w, b = _randn(0, 4, device=device), _randn(1, 4, device=device)
        w2 = _randn(2, 4, 3, device=device)
        mean = torch.zeros(4, dtype=DTYPE, device=device)
        var = torch.ones(4, dtype=DTYPE, device=device)
        history = []
        for step in range(3):
            x = _randn(10 + step, 5, 4, device=device)
            if wrapper == "each_step":
                f = wrap(_functional_batch_norm)
            out = f(x, w, b, mean, var, w2)
            out.sin().sum().backward()
            history.append((out, _grads([x, w, b, w2]), mean.clone(), var.clone()))
            for t in (w, b, w2):
                t.grad = None
        return history

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


# 6. Modules reached through functools.partial, and functional_call ----------------------------


class _Block(nn.Module):
    def __init__(self, wrap, reach):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.wrap, self.reach = wrap, reach

    def body(self, x):
        return torch.tanh(self.lin(x)) @ self.lin.weight

    def forward(self, x):
        fn = functools.partial(_Block.body, self) if self.reach == "partial" else self.body
        return self.wrap(fn)(x)


REACHES = ("partial", "bound_method")


def _blocks(policy, reach, device):
    torch.manual_seed(0)
    plain = _Block(lambda f: f, reach).double().to(device)
    kept = copy.deepcopy(plain)
    kept.wrap = functools.partial(remat, policy=policy)
    return plain, kept


def _other_params(block, requires_grad=True):
    return {
        n: (p.detach() * 1.5 + 0.25).requires_grad_(requires_grad)
        for n, p in block.named_parameters()
    }


@each_policy
@each_device
def test_partial_of_method_reaches_parameters(device, policy):
    """remat(functools.partial(Block.body, block)): gradients reach block's parameters."""
    plain, kept = _blocks(policy, "partial", device)

    def run(block, fn):
        x = _randn(0, 3, 4, device=device)
        out = fn(x)
        out.sin().sum().backward()
        return out, _grads([x, *block.parameters()])

    expected = run(plain, functools.partial(_Block.body, plain))
    assert_tree_equal(
        run(kept, remat(functools.partial(_Block.body, kept), policy=policy)), expected
    )


@pytest.mark.parametrize("reach", REACHES)
@each_policy
@each_device
def test_functional_call_params_backward_after_return(device, policy, reach):
    """functional_call with other params, backward after it returned: plain's grads of them."""
    plain, kept = _blocks(policy, reach, device)

    def run(block):
        x, params = _randn(0, 3, 4, device=device), _other_params(block)
        out = functional_call(block, params, (x,))
        out.sin().sum().backward()
        return out, _grads([x, *params.values(), *block.parameters()])

    assert_tree_equal(run(kept), run(plain))


@pytest.mark.parametrize("reach", REACHES)
@each_policy
@each_device
def test_func_grad_of_functional_call(device, policy, reach):
    """torch.func.grad over functional_call's params equals plain's."""
    plain, kept = _blocks(policy, reach, device)

    def run(block):
        x = _randn(0, 3, 4, requires_grad=False, device=device)
        params = _other_params(block, False)
        loss = lambda p: functional_call(block, p, (x,)).sin().sum()
        return torch.func.grad(loss)(params)

    assert_tree_equal(run(kept), run(plain))


# 7. Custom pytree nodes in an optree namespace ------------------------------------------------


class _Holder:
    """Two tensors, a pytree node only in the namespace `NS`."""

    def __init__(self, a, b):
        self.a, self.b = a, b


optree.register_pytree_node(
    _Holder, lambda h: ((h.a, h.b), None), lambda _, children: _Holder(*children), namespace=NS
)


def _holder_fn(h):
    return (h.a @ h.b).sin() @ h.b


@each_policy
@each_device
def test_namespace_node_gradients_reach_its_tensors(device, policy):
    """remat(fn, namespace=NS) on a node registered in NS: gradients reach its tensors."""

    def run(wrap):
        a, b = _randn(0, 3, 3, device=device), _randn(1, 3, 3, device=device)
        out = wrap(_holder_fn)(_Holder(a, b))
        out.sin().sum().backward()
        return out, _grads([a, b])

    assert_tree_equal(run(lambda f: remat(f, policy=policy, namespace=NS)), run(lambda f: f))


@pytest.mark.parametrize("container", ["dict", "namespace"])
@each_policy
@each_device
def test_in_place_change_of_input_in_node_raises(device, policy, container):
    """Modifying an input tensor in place before backward raises, in a dict or an NS node."""
    a, b = _randn(0, 3, 3, device=device), _randn(1, 3, 3, device=device)
    if container == "dict":
        out = remat(lambda d: _holder_fn(_Holder(d["a"], d["b"])), policy=policy)({"a": a, "b": b})
    else:
        out = remat(_holder_fn, policy=policy, namespace=NS)(_Holder(a, b))
    with torch.no_grad():
        a.mul_(2)
    with pytest.raises(RuntimeError, match="modified"):
        out.sin().sum().backward()


# 8. A region that modifies its own input in place ---------------------------------------------

BODIES = {
    "mul_cos": lambda y: y.mul_(2).cos(),
    "mul_cos_exp": lambda y: y.mul_(2).cos().exp(),
}


def _nested(wrap, body):
    inner = wrap(body)
    return wrap(lambda x: inner(x.sin()).exp())


def _single(wrap, body):
    region = wrap(body)
    return lambda x: region(x.sin())


@pytest.mark.parametrize("nesting", [_nested, _single], ids=["nested", "single"])
@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
@each_policy
@each_device
def test_input_modified_inside_fn_is_equal_or_named(device, policy, body, nesting):
    """fn modifies its (non-leaf) input in place: plain's gradients, or says it was inside fn."""

    def run(wrap):
        x = _randn(0, 3, 3, device=device)
        out = nesting(wrap, body)(x)
        out.sum().backward()
        return out, _grads([x])

    _equal_or_recompute_error(
        lambda: run(lambda f: f), lambda: run(lambda f: remat(f, policy=policy)), "inside"
    )


# 9. Threads with dropout ----------------------------------------------------------------------


def _dropout(h):
    return F.dropout(h, 0.5, training=True)


def _native_dropout(h):
    # The op CUDA's dropout runs: no `generator=` argument, so a draw lends its state to
    # the shared generator for the op.
    return torch.native_dropout(h, 0.5, True)[0]


def _dropout_region(dropout):
    def region(x, w):
        # Two draws, with the GIL released between them: other threads draw in between.
        h = x @ w
        a = dropout(h)
        time.sleep(0)
        b = dropout(h)
        return a, b, (a + b).sum()

    return region


def _exact_inputs(seed, device):
    """x: odd integers (3 columns), w: odd quarters; x @ w is never 0, every sum is exact."""
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randint(-2, 2, (4, 3), generator=gen) + 1).to(device, DTYPE)
    w = (2 * torch.randint(-4, 4, (3, 5), generator=gen) + 1).to(device, DTYPE) / 4
    return x.requires_grad_(), w.requires_grad_()


@pytest.mark.parametrize("dropout", [_dropout, _native_dropout], ids=["dropout", "native"])
@each_policy
@each_device
def test_threads_with_dropout_match_their_own_masks(device, policy, dropout):
    """4 threads x 30 dropout forward+backward: each gradient follows its own forward's mask,
    also where a draw lends a state to the shared generator (CUDA's dropout: a recompute on
    autograd's device thread lent it while another thread's forward drew)."""
    f = remat(_dropout_region(dropout), policy=policy)
    threads, barrier = 4, threading.Barrier(4)
    wrong: list[str] = []
    errors: list[BaseException] = []

    def work(seed):
        x, w = _exact_inputs(seed, device)
        barrier.wait()
        for i in range(30):
            x.grad = w.grad = None
            try:
                a, b, s = f(x, w)
                s.backward()
            except Exception as error:  # a RecomputeError too: a valid program
                errors.append(error)
                return
            scaled = ((a.detach() != 0).to(DTYPE) + (b.detach() != 0).to(DTYPE)) * 2
            expected = [scaled @ w.detach().t(), x.detach().t() @ scaled]
            if not all(torch.equal(g, e) for g, e in zip([x.grad, w.grad], expected, strict=True)):
                wrong.append(f"thread {seed}, call {i}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        pool = [threading.Thread(target=work, args=(seed,)) for seed in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert not wrong, f"{len(wrong)} of {threads * 30} gradients miss their mask: {wrong[:5]}"


def _at_once(threads, fn):
    """``fn()`` in ``threads`` threads let go together: what each returned."""
    barrier, got = threading.Barrier(threads), []
    pool = [
        threading.Thread(target=lambda: (barrier.wait(), got.append(fn()))) for _ in range(threads)
    ]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return got


def _slow(cls, monkeypatch, module):
    """``module.cls`` made slow to construct: threads that all miss a cache make one each."""

    class Slow(cls):
        __slots__ = ()

        def __init__(self, *args):
            time.sleep(0.05)
            super().__init__(*args)

    monkeypatch.setattr(module, cls.__name__, Slow)


def test_threads_meeting_an_op_first_at_once_share_its_record(monkeypatch):
    """Signatures compare an op's record by identity. Two records of one op, made by threads
    that met it first at once, made the recompute match none of the forward's ops: a false
    RecomputeError in the first calls ("value #0 (output of aten.mm) was never rebuilt")."""
    func = torch.ops.aten.sinh.default
    monkeypatch.delitem(_provenance._OPS, id(func), raising=False)
    _slow(_provenance.Op, monkeypatch, _provenance)
    records = _at_once(4, lambda: _provenance.op_info(func))
    assert len(records) == 4
    assert all(r is records[0] for r in records)


_FIRST_OPS_IN_THREADS = """
import sys, threading, torch
import remat

def region(x):
    y = x.sin()
    return y * (x.is_set_to(y) + torch.equal(x, y) + 1)

f = remat.remat(region, policy=remat.policies.save_matmuls)
barrier = threading.Barrier(4)

def work():
    x = torch.ones(3, requires_grad=True)
    barrier.wait()
    f(x).sum().backward()

sys.setswitchinterval(1e-5)
pool = [threading.Thread(target=work) for _ in range(4)]
for t in pool:
    t.start()
for t in pool:
    t.join()
print("default" in vars(torch.ops.aten.geqrf))  # an op no one ran: made by remat
"""


def test_threads_sending_ops_to_remats_mode_first_at_once_do_not_crash(tmp_path):
    """torch makes an op's Python object when it first reaches a Python dispatch mode, and
    two threads doing so at once leave it a freed one: a segmentation fault (before, 1 run
    in 3 of this; 5 of 8 of 4 threads with batch norm under save_matmuls). remat makes every
    op's object once, when its mode is first made with other threads alive."""
    assert run_alone(_FIRST_OPS_IN_THREADS, tmp_path) == ["True"]


def test_threads_meeting_a_module_first_at_once_share_its_record(monkeypatch):
    """What a module's first forwards learn (programs, in-place updates) goes in one record."""
    module = nn.Linear(2, 2)
    _slow(_modules._Learned, monkeypatch, _modules)
    records = _at_once(4, lambda: _modules._learning(module))
    assert len(records) == 4
    assert all(r is records[0] for r in records)


# 10. False divergence -------------------------------------------------------------------------


def _reshape_2d(x, w):
    return (x @ w).reshape(-1).view(x.shape[0], -1).tanh()


def _reshape_batched(x, w):
    # The batched product reshapes a transposed operand: `_reshape_alias` without a Python
    # dispatch mode, `view` under one (or on a subclass).
    h = (x @ w).tanh()
    return (h @ h.transpose(1, 2)).reshape(-1).view(x.shape[0], -1).sin()


RESHAPING = {"2d": (_reshape_2d, (3, 4)), "batched": (_reshape_batched, (2, 3, 4))}
each_block = pytest.mark.parametrize(("block", "shape"), RESHAPING.values(), ids=RESHAPING.keys())


@each_block
@each_policy
@each_device
def test_forward_under_flop_counter_backward_outside(device, policy, block, shape):
    """Forward inside FlopCounterMode, backward outside it: plain's gradients."""

    def run(wrap):
        x, w = _randn(0, *shape, device=device), _randn(1, 4, 4, device=device)
        with FlopCounterMode(display=False):
            out = wrap(block)(x, w)
        out.sin().sum().backward()
        return out, _grads([x, w])

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


class _PostBackward(torch.autograd.Function):
    """Returns its inputs, as FSDP2's post-backward hook registration does."""

    @staticmethod
    def forward(ctx, *inputs):
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        return grads


def _hooked_outside_backward(x, w):
    # FSDP2 registers its post-backward function only outside backward: the forward has
    # an identity op (a view made by autograd) that the recompute does not.
    h = x * 2
    if torch._C._current_graph_task_id() == -1:
        (h,) = _PostBackward.apply(h)
    return torch.tanh(h @ w).sin()


@each_policy
@each_device
def test_identity_function_in_forward_only(device, policy):
    """An autograd.Function returning its input, in the forward only: plain's gradients."""

    def run(wrap):
        x, w = _randn(0, 3, 4, device=device), _randn(1, 4, 4, device=device)
        out = wrap(_hooked_outside_backward)(x, w)
        out.sum().backward()
        return out, _grads([x, w])

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


class _Sub(torch.Tensor):
    pass


@each_block
@each_policy
@each_device
def test_trivial_tensor_subclass_input(device, policy, block, shape):
    """A trivial torch.Tensor subclass input gives plain's outputs and gradients."""

    def run(wrap):
        x, w = _randn(0, *shape, device=device), _randn(1, 4, 4, device=device)
        out = wrap(block)(x.as_subclass(_Sub), w)
        out.sin().sum().backward()
        return out.as_subclass(torch.Tensor), _grads([x, w])

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


@each_block
@each_policy
def test_trivial_tensor_subclass_from_outside(policy, block, shape):
    """A trivial torch.Tensor subclass the region reads from outside (a closure), not as an
    argument: plain's outputs and gradients (the per-op policies' recompute did not look
    for the aliases its outputs re-wrap, and raised: "never rebuilt")."""

    def run(wrap):
        x, w = _randn(0, *shape), _randn(1, 4, 4, requires_grad=False).as_subclass(_Sub)
        out = wrap(lambda x: block(x, w) * (1 + w.sum()))(x)
        out.sin().sum().backward()
        return out.as_subclass(torch.Tensor), _grads([x])

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


@each_policy
def test_trivial_tensor_subclass_made_inside_after_an_op(policy):
    """A trivial subclass made inside ``fn`` from an op's output: plain's outputs and
    gradients (the recompute looked for the aliases its outputs re-wrap from its start, and
    found the op's output where the forward had not: a per-op policy raised)."""

    def f(x, w):
        return (F.linear(x, w).as_subclass(_Sub) @ w).tanh().as_subclass(torch.Tensor)

    def run(wrap):
        x, w = _randn(0, 4, 4), _randn(1, 4, 4)
        out = wrap(f)(x, w)
        out.sin().sum().backward()
        return out, _grads([x, w])

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


def _two_tensor_block(x, w):
    h = F.dropout((x @ w).tanh(), 0.5)
    return (h @ w.t()).reshape(-1).view(x.shape[0], -1).sin() * x


def _dropout_of_a_product(x, w):
    h = F.dropout(x @ w, 0.3)  # dropout reads only the product's layout
    return (h.sin() * h).reshape(-1).view(x.shape[0], -1)


@pytest.mark.parametrize("block", [_two_tensor_block, _dropout_of_a_product])
@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
@each_device
def test_wrapper_tensor_subclass_input(device, policy, block):
    """A wrapper subclass (``__torch_dispatch__``, as DTensor) through products, dropout
    and reshapes: plain's outputs, gradients and random numbers. A kept product of one
    has no storage of its own (a per-op policy raised on it); a skipped one's plain
    ``meta`` stand-in gave dropout one plain mask, not the pair's two (a wrong gradient)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def run(wrap):
        a, w = _randn(0, 3, 4, device=device), _randn(1, 4, 4, device=device)
        x = TwoTensor(a, a * 2).requires_grad_()
        w.requires_grad_()
        torch.manual_seed(2)
        out = wrap(block)(x, w)
        assert type(out) is TwoTensor
        (out.sin() * out).sum().backward()
        return out.a, out.b, x.grad.a, x.grad.b, w.grad, torch.rand(2, device=device)

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


def _wraps_inside(x, w):
    from torch.testing._internal.two_tensor import TwoTensor

    return (TwoTensor(x, x * 2) @ w).relu().sum(-1)


@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_wrapper_subclass_made_inside_fn(policy):
    """A wrapper subclass that ``fn`` builds from a value of the region, a tensor made
    outside aten that C++ holds too: plain's outputs and gradient (a per-op policy kept no
    copy of it to check its recompute twin against, and raised)."""

    def run(wrap):
        x, w = _randn(0, 3, 4), _randn(1, 4, 4)
        out = wrap(_wraps_inside)(x, w)
        out.sum().backward()
        return out.a, out.b, w.grad

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


def test_wrapper_subclass_made_inside_fn_that_differs_in_the_recompute_raises():
    """The recompute's twin of such a subclass must equal the forward's: one built from
    values that changed (Python state read through ``.numpy()``) raises."""
    from torch.testing._internal.two_tensor import TwoTensor

    shift = [0.0]

    def f(x, w):
        base = torch.from_numpy(x.detach().numpy() + shift[0])
        return (TwoTensor(base, base * 2) @ w).relu().sum(-1)

    out = remat(f, policy="save_matmuls")(_randn(0, 3, 4), _randn(1, 4, 4))
    shift[0] = 1.0
    with pytest.raises(RecomputeError, match="never rebuilt"):
        out.sum().backward()


def _written_through_data(x, w):
    h = x @ w
    h.data.mul_(2)  # an alias with a version counter of its own: h's version does not move
    return h.sin() * h


def _written_through_set_(x, w):
    h = (x @ w).sin()
    alias = torch.empty(0, dtype=h.dtype)
    alias.set_(h.detach())  # its own version counter too
    alias.mul_(3)
    return h.exp() * h


def _written_through_set_storage(x, w):
    h = x @ w
    alias = torch.empty(0, dtype=h.dtype)
    alias.set_(h.detach().untyped_storage(), h.storage_offset(), h.shape, h.stride())
    alias.mul_(3)
    return F.dropout(h.sin(), 0.3) * h  # values saved after the write


def _written_through_unsafe_split(x, w):
    # unsafe_split's pieces share h's memory, each with a version counter of its own (as
    # in the CPU LSTM cell): two kept values, h and the pieces, show one memory
    a, b = torch.unsafe_split(x @ w, 2, 1)
    a.sigmoid_()
    b.tanh_()
    return (a * b).tanh()


def _written_through_unsafe_view(x, w):
    # a matmul of a 3-d input returns mm's output through _unsafe_view: no shared counter
    h = x.reshape(3, 2, 2) @ w[:2]
    h.mul_(2)
    return h.sin() * h


@pytest.mark.parametrize(
    "fn",
    [
        _written_through_data,
        _written_through_set_,
        _written_through_set_storage,
        _written_through_unsafe_split,
        _written_through_unsafe_view,
    ],
)
@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_kept_value_written_through_an_alias_of_its_own(policy, fn):
    """A value a policy keeps, then written in place inside ``fn`` through an alias that
    does not share its version counter (``.data``, ``set_``, ``unsafe_split``'s pieces,
    ``_unsafe_view``): plain's outputs and gradients
    on every call. The kept value held the written values, and the recompute wrote them
    again (a silent wrong gradient); it is not kept now. A storage that ``set_`` reads is
    described by the op that made its memory (the recompute's is another object)."""

    def run(wrap):
        torch.manual_seed(3)
        x, w = _randn(0, 3, 4).requires_grad_(), _randn(1, 4, 4).requires_grad_()
        out = wrap(x, w)
        out.sum().backward()
        return out, x.grad, w.grad

    f = remat(fn, policy=policy)
    for _ in range(3):  # later calls follow the program of the first
        assert_tree_equal(run(f), run(fn))


def _set_onto_an_argument(x, w):
    view = torch.empty(0, dtype=w.dtype)
    view.set_(w.detach().untyped_storage(), 4, (3, 4), (4, 1))  # w's last 3 rows
    return ((x @ w) * view).tanh()


@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_set_onto_an_arguments_memory_is_replayed(policy):
    """``set_`` onto an argument's memory: the forward described the storage once the op
    ran, as its own target's (made by ``empty``), the recompute before it ran, as the
    argument's: the per-op policies raised ('rebuilt 0 of the 2 values') on a valid
    program. Both describe it before it runs now."""

    def run(wrap):
        x, w = _randn(0, 3, 4).requires_grad_(), _randn(1, 4, 4).requires_grad_()
        out = wrap(x, w)
        out.sum().backward()
        return out, x.grad, w.grad

    f = remat(_set_onto_an_argument, policy=policy)
    for _ in range(3):  # later calls follow the program of the first
        assert_tree_equal(run(f), run(_set_onto_an_argument))


@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_lstm_with_dropout_trains_as_plain(policy):
    """``nn.LSTM`` on CPU writes its gates in place through ``unsafe_split``: plain's
    outputs, gradients and generator state (memory budgets gave other gradients)."""

    def run(wrap):
        torch.manual_seed(0)
        lstm = nn.LSTM(6, 6, num_layers=2, dropout=0.3, batch_first=True).double()
        x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
        out = wrap(lambda x: lstm(x)[0])(x)
        out.square().sum().backward()
        return out, x.grad, [p.grad for p in lstm.parameters()], torch.get_rng_state()

    assert_tree_equal(run(functools.partial(remat, policy=policy)), run(lambda f: f))


@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_sparse_tensor_made_inside_fn(policy):
    """A sparse value the backward reads, made inside ``fn``: plain's gradients. remat
    remembered every value it gave by its storage, which a sparse tensor has not (it
    raised ``NotImplementedError``)."""

    def fn(x, w):
        return torch.sparse.mm(x.to_sparse(), w).exp()

    def run(wrap):
        x, w = _randn(0, 4, 4), _randn(1, 4, 4)
        out = wrap(x, w)
        out.sum().backward()
        return out, x.grad, w.grad

    f = remat(fn, policy=policy)
    for _ in range(2):
        assert_tree_equal(run(f), run(fn))


class _Doubling(torch.overrides.TorchFunctionMode):
    """A user's function mode that changes what ``sin`` computes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.Tensor.sin else out


@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_function_mode_around_the_call_is_replayed(policy):
    """A torch function mode around the call (``torch.device(...)`` is one): autograd runs
    the recompute with none, so remat enters the forward's. Plain's gradients, where the
    default policy gave others with no error and per-op policies raised."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * x).exp()

    def grad(f):
        x = torch.linspace(0, 1, 4, dtype=torch.float64, requires_grad=True)
        with _Doubling():
            return torch.autograd.grad(f(x).sum(), x)[0]

    f = remat(fn, policy=policy)
    for _ in range(2):
        assert_tree_equal(grad(f), grad(fn))


class _DoublingClones(torch.overrides.TorchFunctionMode):
    """A user's function mode that changes what ``Tensor.clone`` computes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.Tensor.clone else out


class _Bfloat16(torch.utils._python_dispatch.TorchDispatchMode):
    """A user's dispatch mode that emulates bfloat16: the float32 value each op computes is
    rounded (an op's alias of its input, a view or ``detach``, is not)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        computed = func._schema.returns[0].alias_info is None
        if computed and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            return out.to(torch.bfloat16).float()
        return out


@pytest.mark.parametrize("mode", [_DoublingClones, _Bfloat16], ids=["function", "dispatch"])
@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_a_users_mode_around_the_step_sees_only_fns_ops(policy, mode):
    """A value-changing mode of the user's around forward and backward: remat's own copies
    of module state (a batch norm's statistics) and of kept values pass below it, so the
    outputs, gradients, buffers and RNG state are plain's. They were not (a silent wrong
    gradient under the default policy)."""
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.GELU(), nn.Linear(8, 8)
    )
    x = torch.randn(4, 8)

    def run(wrap):
        model = copy.deepcopy(base)
        f = wrap(model)
        torch.manual_seed(3)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with mode():
                out = f(x)
                out.square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        return out, grads, list(model.buffers()), torch.get_rng_state()

    assert_tree_equal(run(lambda m: remat(m, policy=policy)), run(lambda m: m))


class _NamedNorm(nn.Module):
    """Names batch norm's output, one of its kernel's three (in evaluation too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4).double(), nn.BatchNorm1d(4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return name(self.bn(self.lin(x)), "h").sin()


def _named_maximum(x: torch.Tensor) -> torch.Tensor:
    return name(torch.max(x.exp(), dim=0).values, "h").sin()  # `max` has two outputs


@pytest.mark.parametrize("training", [False, True], ids=["evaluation", "training"])
@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_named_output_of_an_op_with_several(policy, training):
    """``remat.name`` on one output of an op that has several: a policy that keeps it keeps
    them all (a replay gave back the named one alone, and torch raised: "Object of type
    'Tensor' is not an instance of 'sequence'"). Plain's gradients, on every call."""
    torch.manual_seed(0)
    model = _NamedNorm().train(training)
    plain = copy.deepcopy(model)
    f = remat(model, policy=policy)
    for step in range(3):
        x = _randn(step, 5, 4).requires_grad_()
        got = torch.autograd.grad(f(x).sum(), (x, *model.parameters()))
        expected = torch.autograd.grad(plain(x).sum(), (x, *plain.parameters()))
        assert_tree_equal((got, list(model.buffers())), (expected, list(plain.buffers())))
    x = _randn(9, 5, 4).requires_grad_()
    g = remat(_named_maximum, policy=policy)
    for _ in range(2):
        assert_tree_equal(
            torch.autograd.grad(g(x).sum(), x), torch.autograd.grad(_named_maximum(x).sum(), x)
        )


def _sin_cos(a: torch.Tensor) -> torch.Tensor:
    return (a.sin() * a.cos()).sum()


@each_policy
@each_device
def test_tensor_subclass_leaf_and_backward_on_a_subclass(device, policy):
    """A subclass leaf that requires grad, and ``backward()`` called on a subclass: the
    subclass's ``__torch_function__`` runs the backward with subclass functions off, and
    the recompute turns them back on as the forward had them (it saw plain ``cos``
    outputs where the forward saw the subclass's aliases, a false RecomputeError)."""

    def run(wrap):
        x = _randn(0, 4, device=device).detach().as_subclass(_Sub).requires_grad_()
        out = wrap(_sin_cos)(x)
        assert type(out) is _Sub
        out.backward()
        return out.as_subclass(torch.Tensor), x.grad.as_subclass(torch.Tensor)

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


# 11. A generator created inside fn ------------------------------------------------------------


def _local_generator(x):
    g = torch.Generator(x.device).manual_seed(0)
    return (x * torch.rand(x.shape, generator=g, dtype=x.dtype, device=x.device)).sin()


@each_policy
@each_device
def test_generator_seeded_inside_fn(device, policy):
    """A generator made and seeded inside fn draws the same numbers in the recompute."""

    def run(wrap):
        x = _randn(0, 3, 4, device=device)
        out = wrap(_local_generator)(x)
        out.exp().sum().backward()
        return out, _grads([x])

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))


def _written_after_saved(write):
    def f(x, w):
        h = x @ w
        y = h.sin()  # saves h
        write(h)
        return y * h  # saves h again: the recompute runs past the write

    return f


WRITES_AFTER_SAVED = {
    "add_": lambda h: h.add_(1),
    "narrow_copy_": lambda h: h.narrow(1, 0, 2).copy_(torch.ones(3, 2, dtype=h.dtype)),
    "swapaxes_mul_": lambda h: h.swapaxes(0, 1).mul_(2),
    "index_put_accumulate": lambda h: h.index_put_((torch.tensor([0, 0]),), h[1] * 2, True),
    "exp_": lambda h: h.exp_(),
}


@pytest.mark.parametrize("write", WRITES_AFTER_SAVED.values(), ids=WRITES_AFTER_SAVED.keys())
@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_value_written_inside_fn_after_it_was_saved_raises(policy, write):
    """``fn`` writes in place a value an op saved, and a later op saves it again: plain
    autograd raises, and so does remat. The recompute ran on past the write, which the
    first op's value then showed: other gradients, with no error (found by a probe)."""
    f = _written_after_saved(write)
    x, w = _randn(0, 3, 4, requires_grad=False), _randn(1, 4, 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        f(x, w).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        remat(f, policy=policy)(x, w).sum().backward()


@pytest.mark.parametrize("policy", EVERY_POLICY.values(), ids=EVERY_POLICY.keys())
def test_value_written_after_saved_for_a_branch_the_backward_skips(policy):
    """A value saved for the first output, then written, then saved for the second: a
    backward through the second only runs as plain (the check raised at the recompute's
    end, for a value this backward never unpacks: found by a probe)."""

    def f(x, c):
        a = x.sin()
        first = a * c
        a.add_(1)
        return first, a * c

    def run(wrap):
        x, c = _randn(0, 3, 4), _randn(1, 3, 4)
        first, second = wrap(f)(x, c)
        return torch.autograd.grad(second.sum(), (x, c)), first

    assert_tree_equal(run(lambda g: remat(g, policy=policy)), run(lambda g: g))


# 12. Bad arguments, and fn that swallows exceptions -------------------------------------------


def test_aten_op_as_policy_raises_at_remat_call():
    """policy=torch.ops.aten.mm (an op, not a policy) raises TypeError naming `policy`."""
    with pytest.raises(TypeError, match="policy"):
        remat(torch.sin, policy=aten.mm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_offload_to_missing_device_raises_at_remat_call():
    """offload(..., device='cuda') without CUDA raises at remat(...), naming `device`."""
    with pytest.raises((ValueError, RuntimeError), match="device"):
        remat(torch.sin, policy=policies.offload("save_matmuls", device="cuda"))


def _suppress_around_sin(x):
    with contextlib.suppress(BaseException):
        h = x.sin()
    return h.cos()


def _suppress_around_last_save(x):
    h = x.sin()
    with contextlib.suppress(BaseException):
        h = h.exp()
    return h * 2


SUPPRESSING = {"around_sin": _suppress_around_sin, "around_last_save": _suppress_around_last_save}


@pytest.mark.parametrize("fn", SUPPRESSING.values(), ids=SUPPRESSING.keys())
@each_policy
@each_device
def test_fn_suppressing_base_exception(device, policy, fn):
    """fn wraps ops in contextlib.suppress(BaseException): plain's gradients all the same."""

    def run(wrap):
        x = _randn(0, 3, 4, device=device)
        out = wrap(fn)(x)
        out.sum().backward()
        return out, _grads([x])

    assert_tree_equal(run(lambda f: remat(f, policy=policy)), run(lambda f: f))

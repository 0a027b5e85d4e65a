"""remat composes with every torch.func transform, in any order and depth."""

from __future__ import annotations

import functools
import re

import optree
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn
from torch.func import (
    functional_call,
    grad,
    grad_and_value,
    hessian,
    jacfwd,
    jacrev,
    jvp,
    vjp,
    vmap,
)

import remat
from remat import remat as rm
from tests.helpers import each_device, examples, from_seed

F = nn.functional
# Keeps a value whose input the recompute would skip (bodies have no matrix products).
_KEEP_SOFTMAX = remat.policies.save_ops(torch.ops.aten._softmax, torch.ops.aten.exp)
_NAMED = (p for p in vars(remat.policies).values() if isinstance(p, remat.policies.Policy))
POLICIES = [*sorted(_NAMED, key=repr), remat.policies.memory_budget(0.5), _KEEP_SOFTMAX]


# Region bodies. Every one is shape-polymorphic, so any stack of transforms can wrap it,
# and takes and returns pytrees with non-tensor leaves.
def _mix(tree):
    x, (k, none), [y] = tree["x"], tree["k"], tree["y"]
    assert k == 3
    assert none is None
    h = (x * y.sum()).tanh() + x.sin() * x.cos()
    return {"out": h.exp() / (1 + h.square().sum()), "aux": (torch.cumsum(h, -1), "tag")}


def _softmax(tree):
    x, y = tree["x"], tree["y"][0]
    z = torch.softmax(x * 2 + y, dim=-1) if x.dim() else x.sigmoid()
    flipped = z.flip(-1) if z.dim() else z
    return {"out": z * x.exp(), "aux": (flipped.square(), "tag")}


def _inner_grad(tree):
    x = tree["x"]
    g = grad(lambda z: (z.sin() * z.exp()).sum())(x)
    return {"out": (g * x).tanh(), "aux": (g.cos(), "tag")}


def _inner_vmap(tree):
    x = tree["x"]
    if x.dim() == 0:
        return _mix(tree)
    v = vmap(lambda r: r.exp() * r.sum().sin())(x)
    return {"out": v * x, "aux": (v.sqrt(), "tag")}


def _nested(tree):
    inner = rm(lambda t: (t.sin() * 3).exp())
    x = tree["x"]
    return {"out": inner(x.cos()) * x, "aux": (inner(x).tanh(), "tag")}


BODIES = {f.__name__.strip("_"): f for f in (_mix, _softmax, _inner_grad, _inner_vmap, _nested)}


def _program(body):
    """A single-tensor function that calls ``body`` on a pytree and folds its result."""

    def f(x):
        y = x.flip(-1) if x.dim() else x
        result = body({"x": x, "k": (3, None), "y": [y * 0.5]})
        assert result["aux"][1] == "tag"
        return result["out"] + result["aux"][0]

    return f


class _Block(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor(-0.2, dtype=torch.float64))
        self.body = body

    def forward(self, x):
        return self.body(x * self.w + self.b)


# Transforms: each maps a single-tensor function to another one, keeping shapes.
def _t_grad(f):
    return grad(lambda x: f(x).sum())


def _t_grad_and_value(f):
    def g(x):
        dx, value = grad_and_value(lambda x: f(x).sum())(x)
        return dx + value

    return g


def _t_vjp(f):
    def g(x):
        out, vjp_fn = vjp(f, x)
        return vjp_fn(out.cos())[0]

    return g


def _t_jacrev(f):
    return lambda x: jacrev(f)(x).reshape(x.numel(), *x.shape).sum(0)


def _t_jacfwd(f):
    return lambda x: jacfwd(f)(x).reshape(x.numel(), *x.shape).sum(0)


def _t_hessian(f):
    return lambda x: hessian(lambda x: f(x).sum())(x).reshape(x.numel(), *x.shape).sum(0)


def _t_jvp(f):
    return lambda x: jvp(f, (x,), (x.cos(),))[1]


def _t_vmap(in_dims, out_dims, chunk_size):
    def t(f):
        def g(x):
            if x.dim() == 0:
                return f(x)
            return vmap(f, in_dims=in_dims, out_dims=out_dims, chunk_size=chunk_size)(x)

        return g

    t.__name__ = f"vmap(in_dims={in_dims}, out_dims={out_dims}, chunk_size={chunk_size})"
    return t


def _t_functional_call(f):
    """Route ``f`` through a module whose parameters are computed from the input."""
    module = _Block(f)

    def g(x):
        params = {"w": x.mean().sigmoid(), "b": x.std() * 0.1}
        return functional_call(module, params, (x,))

    return g


TRANSFORMS = [
    _t_grad,
    _t_grad_and_value,
    _t_vjp,
    _t_jacrev,
    _t_jacfwd,
    _t_hessian,
    _t_jvp,
    _t_functional_call,
]
transforms = st.one_of(
    st.sampled_from(TRANSFORMS),
    st.builds(
        _t_vmap,
        in_dims=st.sampled_from([0, -1]),
        out_dims=st.sampled_from([0, -1]),
        chunk_size=st.sampled_from([None, 1, 2]),
    ),
)


def _order(stack):
    """How many reverse-mode differentiations a stack nests."""
    reverse = {_t_grad, _t_grad_and_value, _t_vjp, _t_jacrev, _t_hessian}
    return sum(t in reverse for t in stack) + (_t_hessian in stack)


def _apply(stack, f):
    for t in stack:
        f = t(f)
    return f


def _assert_equal(a, b, tol=0.0):
    for p, q in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, equal_nan=True)


# Under two or more grad levels, the outer level differentiates through the recompute's
# graph, which sums the same contributions in another order than the forward's graph:
# results differ from plain in the last bits (seen: 3e-16 relative). From the third order
# on, cancellation magnifies this: seen 1.9e-12 on vjp/hessian/vjp, where plain's own
# result moves by 2.6e-12 when its hessian is taken as jacrev(jacrev) instead.
# First-order stacks are compared bitwise.
def _tolerance(orders):
    return 0.0 if orders <= 1 else 1e-12 if orders == 2 else 1e-11


@examples(100)
# A tangent read at a re-created jvp level: matched to the forward's (CI found it).
@example(stack=[_t_jvp, _t_jacfwd, _t_grad], body="inner_grad", policy=remat.policies.save_matmuls)
# Two grad levels: the outer one differentiates the recompute's own ops, so the recompute
# may skip none (a skipped input of the kept softmax crashed the outer backward).
@example(stack=[_t_grad, _t_grad], body="softmax", policy=_KEEP_SOFTMAX)
@example(stack=[_t_jacfwd, _t_grad], body="softmax", policy=remat.policies.memory_budget(0.5))
# A view from outside under two jvp levels, a wrapper with no storage (fuzz found it).
@example(stack=[_t_jacfwd, _t_jacfwd], body="inner_grad", policy=remat.policies.save_matmuls)
@given(
    stack=st.lists(transforms, min_size=1, max_size=3),
    body=st.sampled_from(sorted(BODIES)),
    policy=st.sampled_from(POLICIES),
)
@each_device
def test_transform_stacks_match_plain(device, stack, body, policy):
    """Any stack of up to three transforms gives what it gives on the plain function."""
    x = torch.linspace(-1.0, 1.3, 12, dtype=torch.float64, device=device).reshape(2, 2, 3)
    try:
        plain = _apply(stack, _program(BODIES[body]))(x)
    except RuntimeError as error:  # torch's own limits (std's backward at third order)
        with pytest.raises(RuntimeError, match=re.escape(str(error)[:60])):
            _apply(stack, _program(rm(BODIES[body], policy=policy)))(x)
        return
    remat_ = _apply(stack, _program(rm(BODIES[body], policy=policy)))(x)
    _assert_equal(plain, remat_, _tolerance(_order(stack) + (body == "inner_grad")))


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize(
    "stack",
    [
        [_t_grad],
        [_t_vjp],
        [_t_vjp, _t_grad],
        [_t_functional_call, _t_grad],
        [_t_jvp, _t_grad],
        [_t_jvp, _t_jacrev],
    ],
    ids=lambda s: "/".join(t.__name__ for t in s),
)
@each_device
def test_random_bodies_under_stacks(device, stack, randomness):
    """Dropout inside the region under vmap(stack) replays exactly; RNG ends as plain."""

    def body(x):
        return F.dropout(x.sin(), 0.4).exp() * torch.rand_like(x)

    def run(f):
        xs = torch.linspace(-1, 1, 12, dtype=torch.float64, device=device).reshape(3, 4)
        return from_seed(lambda: vmap(_apply(stack, f), randomness=randomness)(xs))

    _assert_equal(run(body), run(rm(body)), _tolerance(_order(stack)))


@pytest.mark.parametrize("outer", [_t_grad, _t_vjp, _t_jacrev])
@pytest.mark.parametrize("inner", [_t_jvp, _t_jacfwd])
@pytest.mark.parametrize("policy", POLICIES)
def test_reverse_over_forward_matches_plain_bitwise(outer, inner, policy):
    """Reverse mode over an exited forward-mode level recomputes with the forward's tangents."""
    x = torch.linspace(-1.0, 1.3, 6, dtype=torch.float64).reshape(2, 3)
    plain = outer(inner(_program(_mix)))(x)
    _assert_equal(plain, outer(inner(_program(rm(_mix, policy=policy))))(x))


@pytest.mark.parametrize("outer", [_t_grad, _t_jacrev])
def test_reverse_over_forward_with_duals_read_by_closure(outer):
    """Duals that the region reads by closure get their forward tangents back in the recompute."""
    x = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)

    def program(region):
        def f(w):
            return region(lambda x: (x * w).sin() * w.exp())(x)

        return lambda w: jvp(f, (w,), (w.cos(),))[1]

    w = torch.linspace(0.5, 1.5, 5, dtype=torch.float64)
    _assert_equal(outer(program(lambda g: g))(w), outer(program(rm))(w))


def test_backward_after_functionalize_exited_raises_clearly():
    """A functionalize level that exited before the backward cannot be re-created: it says so."""
    region = rm(lambda x: x.sin().exp())
    _, vjp_fn = torch.func.functionalize(lambda x: vjp(region, x))(torch.randn(3))
    with pytest.raises(NotImplementedError, match="`functionalize` level"):
        vjp_fn(torch.ones(3))


def test_region_is_recomputed_under_grad():
    """Under torch.func.grad the region runs twice (forward, recompute), not once as plain."""
    calls = []

    def body(x):
        calls.append(x.shape)
        return x.sin().exp()

    x = torch.randn(5, dtype=torch.float64)
    expected = grad(lambda x: body(x).sum())(x)
    calls.clear()
    assert torch.equal(grad(lambda x: rm(body)(x).sum())(x), expected)
    assert len(calls) == 2


def test_vjp_fn_called_after_vjp_returns_recomputes_once():
    """vjp_fn, called after its level exited, recomputes the region once per call."""
    calls = []

    def body(x):
        calls.append(1)
        return x.sin().exp()

    x = torch.randn(5, dtype=torch.float64)
    out, vjp_fn = vjp(rm(body), x)
    assert len(calls) == 1
    first = vjp_fn(torch.ones_like(out))
    second = vjp_fn(torch.ones_like(out) * 2)
    assert len(calls) == 3
    _, plain_fn = vjp(body, x)
    _assert_equal(first, plain_fn(torch.ones_like(out)))
    _assert_equal(second, plain_fn(torch.ones_like(out) * 2))


class _MLP(nn.Module):
    def __init__(self, width=8, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + self.block(block, x)
        return x.square().mean()

    def block(self, block, x):
        return block(x)


class _RematMLP(_MLP):
    @rm
    def block(self, block, x):
        return block(x)


def _twin_mlps(width=8, depth=3):
    """A plain MLP and a remat'd one with the same parameters, and those parameters."""
    torch.manual_seed(0)
    plain = _MLP(width, depth).double()
    remat_ = _RematMLP(width, depth).double()
    remat_.load_state_dict(plain.state_dict())
    return plain, remat_, {k: v.detach() for k, v in plain.named_parameters()}


def test_per_sample_gradients_of_a_module():
    """vmap(grad(functional_call)) per-sample gradients of remat'd blocks equal plain."""
    plain, remat_, params = _twin_mlps()
    xs = torch.randn(6, 8, dtype=torch.float64)

    def per_sample(model):
        def loss(p, x):
            return functional_call(model, p, (x,))

        return vmap(grad(loss), in_dims=(None, 0))(params, xs)

    _assert_equal(per_sample(plain), per_sample(remat_))


def test_jacrev_over_module_parameters():
    """jacrev with respect to parameters substituted by functional_call equals plain."""
    plain, remat_, params = _twin_mlps(width=4, depth=2)
    params = {k: v * 1.5 for k, v in params.items()}
    x = torch.randn(3, 4, dtype=torch.float64)

    def jac(model):
        return jacrev(lambda p: functional_call(model, p, (x,)))(params)

    _assert_equal(jac(plain), jac(remat_))


def test_hessian_vector_product_through_functional_call():
    """grad of jvp over module parameters (pinned duals) matches plain autograd bitwise."""
    plain, remat_, params = _twin_mlps(width=4, depth=2)
    direction = {k: torch.randn_like(v) for k, v in params.items()}
    x = torch.randn(3, 4, dtype=torch.float64)

    def hvp(model):
        def loss(p):
            return functional_call(model, p, (x,))

        return grad(lambda p: jvp(loss, (p,), (direction,))[1])(params)

    _assert_equal(hvp(plain), hvp(remat_))


def test_hessian_with_policies_under_functional_call():
    """hessian through functional_call of remat'd blocks equals plain (dead levels, 2nd order)."""
    plain, remat_, params = _twin_mlps(width=3, depth=2)
    x = torch.randn(2, 3, dtype=torch.float64)

    def hess(model):
        return hessian(lambda w: functional_call(model, {**params, "blocks.0.0.weight": w}, (x,)))(
            params["blocks.0.0.weight"]
        )

    _assert_equal(hess(plain), hess(remat_))


@functools.cache
def _stack_mlp(depth=8, width=64, hidden=256):
    torch.manual_seed(0)
    return [
        (
            torch.randn(width, hidden, dtype=torch.float64) / 8,
            torch.randn(hidden, width, dtype=torch.float64) / 16,
        )
        for _ in range(depth)
    ]


def _layer(x, w1, w2):
    return x + F.gelu(x @ w1) @ w2


def _net(x, weights, layer):
    for w1, w2 in weights:
        x = layer(x, w1, w2)
    return x


def test_grad_peak_is_at_most_half_of_plain():
    """Under torch.func.grad, an 8-layer MLP with every layer remat'd peaks at <= 0.5x plain."""
    weights = _stack_mlp()
    x = torch.randn(128, 64, dtype=torch.float64)

    def peak(layer):
        with remat.memory.track() as mem:
            g = grad(lambda x: _net(x, weights, layer).square().sum())(x)
        return mem.peak, g

    plain_peak, plain_grad = peak(_layer)
    remat_peak, remat_grad = peak(rm(_layer))
    assert torch.equal(plain_grad, remat_grad)
    assert remat_peak <= 0.5 * plain_peak, (remat_peak, plain_peak)


@pytest.mark.parametrize(("through_jvp", "bound"), [(False, 0.2), (True, 0.1)])
def test_vjp_holds_little_between_forward_and_backward(through_jvp, bound):
    """Between vjp's forward and vjp_fn remat holds its inputs (and their tangents) only."""
    weights = [(a.clone(), b.clone()) for a, b in _stack_mlp()]
    x, tangent = torch.randn(2, 128, 64, dtype=torch.float64)

    def held(layer):
        def f(x, ws):
            if through_jvp:  # reverse over forward mode
                return jvp(lambda x: _net(x, ws, layer), (x,), (tangent,))[1]
            return _net(x, ws, layer)

        with remat.memory.track() as mem:
            out, vjp_fn = vjp(f, x, weights)
            live = mem.live - out.untyped_storage().nbytes()
            grads = vjp_fn(torch.ones_like(out))
        return live, grads

    plain_held, plain_grads = held(_layer)
    remat_held, remat_grads = held(rm(_layer))
    _assert_equal(plain_grads, remat_grads)
    assert remat_held <= bound * plain_held, (remat_held, plain_held)


def test_per_sample_gradients_peak_is_at_most_half_of_plain():
    """vmap(grad) per-sample gradients of a sequence MLP peak at <= 0.5x plain, bitwise equal."""
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(8):
        weights += [
            torch.randn(32, 128, generator=gen) / 6,
            torch.randn(128, 32, generator=gen) / 12,
        ]
    xs = torch.randn(8, 128, 32, generator=gen)

    def loss(ws, x, layer):
        h = x
        for w1, w2 in zip(ws[::2], ws[1::2], strict=True):
            h = layer(h, w1, w2)
        return h.square().mean()

    def peak(layer):
        with remat.memory.track() as mem:
            grads = vmap(grad(loss), in_dims=(None, 0, None))(weights, xs, layer)
        return mem.peak, grads

    plain_peak, plain_grads = peak(_layer)
    remat_peak, remat_grads = peak(rm(_layer))
    _assert_equal(plain_grads, remat_grads)
    assert remat_peak <= 0.5 * plain_peak, (remat_peak, plain_peak)

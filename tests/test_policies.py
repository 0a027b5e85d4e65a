"""Policies: every form gives plain's gradients; what each keeps, recomputes, holds and reports."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from remat import Residual, memory, name, policies, print_saved_residuals, remat, saved_residuals
from remat.policies import Decision, offload, save_all_but_names, save_names, save_ops
from tests import helpers
from tests.helpers import assert_tree_equal, tensor_leaves

aten = torch.ops.aten
DTYPE = torch.float64
FILE = os.path.basename(__file__)
CPU = torch.device("cpu")
MATMULS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)


class OpCounter(helpers.OpCounter):
    """`helpers.OpCounter`, plus the matmul counts."""

    def matmuls(self):
        return {str(op): self.counts[str(op)] for op in MATMULS}


def _nbytes(t):
    return t.untyped_storage().nbytes()


def _held(fn, *args):
    """Bytes that ``fn(*args)`` allocated and still holds once it returns, less its outputs'."""
    with memory.track() as mem:
        out = fn(*args)
        live = mem.live
    storages = {t.untyped_storage().data_ptr(): _nbytes(t) for t in tensor_leaves(out)}
    return live - sum(storages.values())


def _randn(gen, *shape, dtype=DTYPE, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=dtype) * scale


# A pre-LN transformer block -------------------------------------------------------------------

D, HEADS, HIDDEN = 8, 2, 16


def _layer(seed, d=D, hidden=HIDDEN, dtype=DTYPE, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    params = {
        "ln1": 1 + _randn(gen, d, dtype=dtype, scale=0.1),
        "qkv": _randn(gen, d, 3 * d, dtype=dtype, scale=d**-0.5),
        "o": _randn(gen, d, d, dtype=dtype, scale=d**-0.5),
        "ln2": 1 + _randn(gen, d, dtype=dtype, scale=0.1),
        "up": _randn(gen, d, hidden, dtype=dtype, scale=d**-0.5),
        "b": _randn(gen, hidden, dtype=dtype, scale=0.1),
        "down": _randn(gen, hidden, d, dtype=dtype, scale=hidden**-0.5),
    }
    return {k: v.requires_grad_(requires_grad) for k, v in params.items()}


def _block(x, p, heads=HEADS):
    """Attention (4-D matmuls run as bmm) and an MLP (addmm, gelu); tags "scores" and "up"."""
    d = x.shape[-1]
    h = F.layer_norm(x, (d,), p["ln1"])
    q, k, v = (h @ p["qkv"]).split(d, -1)
    q, k, v = (t.unflatten(-1, (heads, d // heads)).transpose(-2, -3) for t in (q, k, v))
    scores = name(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), -1), "scores")
    x = x + (scores @ v).transpose(-2, -3).flatten(-2) @ p["o"]
    h = F.layer_norm(x, (d,), p["ln2"])
    up = name(F.gelu(torch.addmm(p["b"], h.flatten(0, -2), p["up"])), "up")
    return x + (up @ p["down"]).view(x.shape)


def _stack(block, x, layers):
    for p in layers:
        x = block(x, p)
    return x


def _layers(requires_grad=True):
    return [_layer(seed, requires_grad=requires_grad) for seed in range(3)]


def _tokens(seed=10, shape=(2, 4, D), requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    return _randn(gen, *shape).requires_grad_(requires_grad)


def _keep_batched(call):
    return call.op.overloadpacket in (aten.bmm, aten.baddbmm)


def _offload_up_save_mm(call):
    if "up" in call.names:
        return Decision.OFFLOAD
    return Decision.SAVE if call.op is aten.mm.default else Decision.RECOMPUTE


POLICIES = {
    "'save_nothing'": "save_nothing",
    "'save_everything'": "save_everything",
    "'save_matmuls'": "save_matmuls",
    "'save_matmuls_no_batch'": "save_matmuls_no_batch",
    "save_nothing": policies.save_nothing,
    "save_everything": policies.save_everything,
    "save_matmuls": policies.save_matmuls,
    "save_matmuls_no_batch": policies.save_matmuls_no_batch,
    "save_ops(aten.mm, aten.bmm)": save_ops(aten.mm, aten.bmm),
    "save_ops(addmm.default, _softmax.default)": save_ops(
        aten.addmm.default, aten._softmax.default
    ),
    "save_names('scores')": save_names("scores"),
    "save_names('scores', 'up')": save_names("scores", "up"),
    "save_all_but_names('up')": save_all_but_names("up"),
    "offload(save_matmuls)": offload(policies.save_matmuls),
    "offload('save_matmuls_no_batch', 'cpu')": offload("save_matmuls_no_batch", "cpu"),
    "save_matmuls_no_batch | save_names('scores')": (
        policies.save_matmuls_no_batch | save_names("scores")
    ),
    "save_matmuls & save_all_but_names('scores')": (
        policies.save_matmuls & save_all_but_names("scores")
    ),
    "offload(save_names('up')) | save_matmuls_no_batch": (
        offload(save_names("up")) | policies.save_matmuls_no_batch
    ),
    "offload(save_matmuls) & save_all_but_names('up')": (
        offload(policies.save_matmuls) & save_all_but_names("up")
    ),
    "save_everything | save_nothing": policies.save_everything | policies.save_nothing,
    "memory_budget(0.5)": policies.memory_budget(0.5),
    "offload(memory_budget(0.8))": offload(policies.memory_budget(0.8)),
    "custom -> bool": _keep_batched,
    "custom -> Decision": _offload_up_save_mm,
}


# 1. Every policy form computes plain's outputs and gradients ----------------------------------


def _loss(out):
    return out.sin().sum()


def _eager_backward(block):
    x, layers = _tokens(), _layers()
    out = _stack(block, x, layers)
    _loss(out).backward()
    return out, [x.grad, [{k: v.grad for k, v in p.items()} for p in layers]]


def _eager_grad(block):
    x, layers = _tokens(), _layers()
    out = _stack(block, x, layers)
    leaves = [x, *(v for p in layers for v in p.values())]
    return out, torch.autograd.grad(_loss(out), leaves)


def _func_grad(block):
    x, layers = _tokens(requires_grad=False), _layers(requires_grad=False)
    f = torch.func.grad_and_value(lambda x, layers: _loss(_stack(block, x, layers)), (0, 1))
    return f(x, layers)


def _vmap_grad(block):
    xs = _tokens(shape=(3, 2, 4, D), requires_grad=False)
    layers = _layers(requires_grad=False)
    f = torch.func.grad(lambda x, layers: _loss(_stack(block, x, layers)), (0, 1))
    return torch.func.vmap(f, in_dims=(0, None))(xs, layers)


MODES = {
    "backward": _eager_backward,
    "autograd.grad": _eager_grad,
    "func.grad": _func_grad,
    "vmap(grad)": _vmap_grad,
}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_every_policy_form_gives_plain_gradients(policy, mode):
    """Every policy form computes bitwise plain's outputs and gradients, eager or torch.func."""
    assert_tree_equal(mode(remat(_block, policy=policy)), mode(_block))


# 2. What the recompute runs -------------------------------------------------------------------


def _backward_counts(block):
    x, layers = _tokens(), _layers()
    out = _stack(block, x, layers)
    with OpCounter() as backward:
        out.sum().backward()
    return backward


def test_save_matmuls_replays_matmuls_and_recomputes_the_rest():
    """Under save_matmuls backward runs plain's matmuls only; gelu/softmax/layer_norm re-run."""
    plain = _backward_counts(_block)
    kept = _backward_counts(remat(_block, policy="save_matmuls"))
    assert kept.matmuls() == plain.matmuls()
    assert [plain.counts[op] for op in ("aten.gelu", "aten._softmax")] == [0, 0]
    assert [kept.counts[op] for op in ("aten.gelu", "aten._softmax")] == [3, 3]
    assert kept.counts["aten.native_layer_norm"] == 6


def test_policy_deciding_by_op_is_asked_once_per_op_and_a_callable_every_time():
    """Named policies decide by the op alone (asked once per op and region); a callable
    combined with one is still shown every op call, with its own output."""
    x = torch.randn(4, 4, requires_grad=True)
    calls = []

    def big(call):
        calls.append(call.output.abs().max().item())
        return calls[-1] > 1

    def fn(x):
        return ((x @ x).sin() @ x).cos().sum()

    assert policies.save_matmuls.by_op
    assert offload("save_matmuls").by_op
    assert not (policies.save_matmuls | big).by_op
    with torch.no_grad():
        expected = [v.abs().max().item() for v in (x @ x, (x @ x).sin(), (x @ x).sin() @ x)]
    torch.autograd.grad(remat(fn, policy=policies.save_matmuls | big)(x), x)
    assert calls[:3] == expected


def test_save_nothing_reruns_forward_matmuls():
    """Under save_nothing each block re-runs its matmuls, up to the last one (early stop)."""
    plain = _backward_counts(_block)
    rerun = _backward_counts(remat(_block, policy="save_nothing"))
    # Per block: the qkv and output projections (mm), both attention products (bmm), the MLP
    # up projection (addmm); the down projection comes after the last saved value.
    assert rerun.matmuls() == {
        "aten.mm": plain.counts["aten.mm"] + 2 * 3,
        "aten.addmm": plain.counts["aten.addmm"] + 3,
        "aten.bmm": plain.counts["aten.bmm"] + 2 * 3,
        "aten.baddbmm": 0,
    }


def test_save_matmuls_no_batch_reruns_only_batched_products():
    """Under save_matmuls_no_batch the attention bmm's re-run, mm and addmm are replayed."""
    plain = _backward_counts(_block)
    rerun = _backward_counts(remat(_block, policy="save_matmuls_no_batch"))
    assert rerun.matmuls() == {**plain.matmuls(), "aten.bmm": plain.counts["aten.bmm"] + 2 * 3}


# 3. Bytes held after the forward --------------------------------------------------------------


def _mlp(x, w1, w2):
    return x + F.gelu(x @ w1).sin() @ w2


def test_held_bytes_follow_policy_order_on_mlp_block():
    """MLP block: save_nothing 0 < save_matmuls 1 < save_everything 3 == plain 3 hidden-sized."""
    # Plain keeps x @ w1 (gelu's input), gelu's output (sin's input) and sin's output (the
    # second matmul's input). save_matmuls keeps x @ w1 and recomputes gelu and sin from it.
    gen = torch.Generator().manual_seed(0)
    x = _randn(gen, 16, 8).requires_grad_()
    w1, w2 = _randn(gen, 8, 32).requires_grad_(), _randn(gen, 32, 8).requires_grad_()
    hidden = 16 * 32 * x.element_size()
    held = {
        policy: _held(remat(_mlp, policy=policy), x, w1, w2)
        for policy in ("save_nothing", "save_matmuls", "save_everything")
    }
    assert held == {"save_nothing": 0, "save_matmuls": hidden, "save_everything": 3 * hidden}
    assert _held(_mlp, x, w1, w2) == 3 * hidden


def _held_by_stack(policy):
    block = _block if policy is None else remat(_block, policy=policy)
    layers = _layers()
    return _held(lambda x: _stack(block, x, layers), _tokens())


def test_held_bytes_follow_policy_order_on_transformer_stack():
    """Three blocks: save_nothing < no_batch < save_matmuls < save_everything == plain."""
    held = [
        _held_by_stack(policy)
        for policy in ("save_nothing", "save_matmuls_no_batch", "save_matmuls", "save_everything")
    ]
    print(f"\nheld after forward (nothing, no_batch, matmuls, everything): {held}")
    assert held == sorted(set(held))
    assert held[-1] == _held_by_stack(None)


def test_save_matmuls_no_batch_holds_matmuls_less_attention_products():
    """On an attention block no_batch holds save_matmuls' bytes less its bmm outputs."""
    x, p = _tokens(), _layer(0)
    kept = [r for r in saved_residuals(remat(_block, policy="save_matmuls"), x, p) if r.op]
    batched = sum(r.nbytes for r in kept if r.op.overloadpacket is aten.bmm)
    assert [r.op.overloadpacket for r in kept] == [
        aten.mm,
        aten.bmm,
        aten.bmm,
        aten.mm,
        aten.addmm,
    ]
    matmuls = _held(remat(_block, policy="save_matmuls"), x, p)
    no_batch = _held(remat(_block, policy="save_matmuls_no_batch"), x, p)
    assert no_batch == matmuls - batched
    assert batched > 0


# 4. Names -------------------------------------------------------------------------------------


def _named(x, w, w2):
    h = name(torch.tanh(x @ w), "h")
    return (h @ w2).sin()


def _small_named():
    gen = torch.Generator().manual_seed(1)
    x = _randn(gen, 6, 5).requires_grad_()
    return x, _randn(gen, 5, 7).requires_grad_(), _randn(gen, 7, 3).requires_grad_()


def test_save_names_holds_exactly_the_named_tensor():
    """save_names("h") holds h's bytes more than save_nothing, and h is what it lists."""
    args = _small_named()
    h = torch.tanh(args[0] @ args[1])
    nothing = _held(remat(_named, policy="save_nothing"), *args)
    named = _held(remat(_named, policy=save_names("h")), *args)
    assert (nothing, named) == (0, _nbytes(h))
    kept = saved_residuals(remat(_named, policy=save_names("h")), *args)
    assert [(r.kind, r.op, r.name) for r in kept if r.kind != "input"] == [
        ("saved", aten.tanh.default, "h")
    ]


def _outer_product(x, w, w2):
    a = torch.tanh(x @ w)
    h = name(a.unsqueeze(-1) * a.unsqueeze(-2), "h")
    return (h @ w2).sin()


def test_save_all_but_names_lies_between_nothing_and_everything():
    """save_all_but_names("h") holds more than save_nothing and less than save_everything.

    ``h`` is a (6, 16, 16) outer product of the small ``a = tanh(x @ w)``, which tanh's
    backward keeps anyway. Everything but ``h`` may be kept: ``a`` and the last matmul's
    output (sin's input) are; ``h`` itself, which plain autograd holds for that matmul, is
    recomputed from ``a``. So the policy holds something (sin's input), and at least h's
    bytes less than plain.
    """
    gen = torch.Generator().manual_seed(2)
    x, w = _randn(gen, 6, 4).requires_grad_(), _randn(gen, 4, 16).requires_grad_()
    w2 = _randn(gen, 16, 1).requires_grad_()
    args = (x, w, w2)
    h_bytes = 6 * 16 * 16 * x.element_size()
    held = {
        policy: _held(remat(_outer_product, policy=policy), *args)
        for policy in ("save_nothing", "save_everything")
    }
    all_but = _held(remat(_outer_product, policy=save_all_but_names("h")), *args)
    assert held["save_nothing"] < all_but <= held["save_everything"] - h_bytes
    kept = saved_residuals(remat(_outer_product, policy=save_all_but_names("h")), *args)
    assert all(r.name is None for r in kept)
    assert [r.op for r in kept if r.kind == "saved"] == [
        aten.tanh.default,
        aten._unsafe_view.default,
    ]
    assert_tree_equal(
        torch.autograd.grad(
            remat(_outer_product, policy=save_all_but_names("h"))(*args).sum(), args
        ),
        torch.autograd.grad(_outer_product(*args).sum(), args),
    )


# 5. Never hold what no backward reads ---------------------------------------------------------


def _add_last(x, w):
    return x @ w + 1


def _add_then_saved(x, w):
    # The add reads x @ w and saves nothing; exp's output is saved, and the recompute runs up
    # to it, but nothing it needs reads the add's output.
    return (x @ w + 1) + x.exp()


def _view_then_kept(x, w):
    return (x @ w).t().exp()


def _kept_then_kept(x, w):
    return (x @ w + 1).exp()


UNREAD = {
    "mm->add, nothing saved after": (_add_last, "save_matmuls", "save_nothing"),
    "mm->add, a value saved after": (_add_then_saved, "save_matmuls", "save_nothing"),
    "mm->view->kept exp": (_view_then_kept, save_ops(aten.mm, aten.exp), save_ops(aten.exp)),
    "mm->kept add->exp": (_kept_then_kept, save_ops(aten.mm, aten.add), save_ops(aten.add)),
}


@pytest.mark.parametrize(("fn", "policy", "without_mm"), UNREAD.values(), ids=UNREAD.keys())
def test_kept_matmul_no_backward_reads_is_not_held(fn, policy, without_mm):
    """A kept mm output that no backward reads costs nothing, and the recompute skips the mm."""
    # `without_mm` is the same policy without mm: holding more than it means holding x @ w.
    gen = torch.Generator().manual_seed(3)
    x, w = _randn(gen, 32, 32).requires_grad_(), _randn(gen, 32, 32).requires_grad_()
    assert _held(remat(fn, policy=policy), x, w) == _held(remat(fn, policy=without_mm), x, w)
    counts = []
    for f in (fn, remat(fn, policy=policy)):
        out = f(x, w)
        with OpCounter() as backward:
            grads = torch.autograd.grad(out.sum(), (x, w))
        counts.append((backward.counts["aten.mm"], grads))
    assert_tree_equal(counts[1], counts[0])


# 6. saved_residuals ---------------------------------------------------------------------------

LINE = _named.__code__.co_firstlineno


def _expected_named(kind, op, name_, line, device=CPU):
    shapes = {1: (6, 7), 2: (6, 3)}
    return Residual(
        shapes[line],
        DTYPE,
        device,
        6 * 8 * shapes[line][1],
        kind,
        op,
        name_,
        f"output of {op.overloadpacket} at {FILE}:{LINE + line}",
    )


def _inputs(*names_shapes):
    return [
        Residual(shape, DTYPE, CPU, math.prod(shape) * 8, "input", None, None, f"argument `{n}`")
        for n, shape in names_shapes
    ]


INPUTS = _inputs(("x", (6, 5)), ("w", (5, 7)), ("w2", (7, 3)))
LISTINGS = {
    "save_nothing": ("save_nothing", INPUTS),
    "save_matmuls": (
        "save_matmuls",
        [
            *INPUTS,
            _expected_named("saved", aten.mm.default, None, 1),
            _expected_named("saved", aten.mm.default, None, 2),
        ],
    ),
    "save_names": (save_names("h"), [*INPUTS, _expected_named("saved", aten.tanh.default, "h", 1)]),
    "offload(save_names)": (
        offload(save_names("h")),
        [*INPUTS, _expected_named("offloaded", aten.tanh.default, "h", 1)],
    ),
    "save_ops | save_names": (
        save_ops(aten.mm.default) | save_names("h"),
        [
            *INPUTS,
            _expected_named("saved", aten.tanh.default, "h", 1),
            _expected_named("saved", aten.mm.default, None, 2),
        ],
    ),
}


@pytest.mark.parametrize(("policy", "expected"), LISTINGS.values(), ids=LISTINGS.keys())
def test_saved_residuals_lists_inputs_and_kept_values(policy, expected):
    """Records name each kept value's kind, aten op, tag and source line; inputs come first."""
    assert saved_residuals(remat(_named, policy=policy), *_small_named()) == expected


def test_saved_residuals_of_plain_function_lists_what_autograd_keeps():
    """On a plain function: the arguments autograd saves, then each saved value's op and line."""
    args = _small_named()

    def saved(shape, op, line):
        source = f"output of {op.overloadpacket} at {FILE}:{LINE + line}"
        return Residual(shape, DTYPE, CPU, math.prod(shape) * 8, "saved", op, None, source)

    argument = [
        Residual(a.shape, DTYPE, CPU, _nbytes(a), "input", None, None, "an argument") for a in args
    ]
    records = saved_residuals(_named, *args)
    assert records == [
        argument[1],  # mm saves its second operand first
        argument[0],
        argument[2],
        saved((6, 7), aten.tanh.default, 1),  # tanh's output, also the second mm's input
        saved((6, 3), aten.mm.default, 2),  # sin's input
    ]
    assert sum(r.nbytes for r in records if r.kind != "input") == _held(_named, *args)
    assert saved_residuals(remat(_named, policy="save_everything"), *args) == records


def test_saved_residuals_of_plain_block_name_their_ops():
    """On a plain transformer block every saved value names its aten op and source line."""
    records = saved_residuals(_block, _tokens(), _layer(0))
    assert len(records) > 7
    for r in records[7:]:
        assert r.kind == "saved"
        assert isinstance(r.op, torch._ops.OpOverload), r
        assert re.fullmatch(rf"output of {r.op.overloadpacket} at {FILE}:\d+", r.source), r


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_saved_residuals_agree_with_memory_tracker(policy):
    """The bytes saved_residuals lists besides inputs are the bytes the tracker sees held."""
    x, p = _tokens(), _layer(0)
    fn = remat(_block, policy=policy)
    records = saved_residuals(fn, x, p)
    assert {r.kind for r in records} <= {"input", "saved", "offloaded"}
    for r in records:
        if r.kind != "input" and fn.policy is not policies.save_everything:
            assert isinstance(r.op, torch._ops.OpOverload), r
            budget = r"; memory_budget\(.+\) keeps it \(spares recompute cost .+\)"
            where = rf"output of {r.op.overloadpacket} at {FILE}:\d+"
            assert re.fullmatch(where + (budget if fn.policy.budget else ""), r.source), r
    held = sum(r.nbytes for r in records if r.kind != "input")
    assert held == _held(fn, x, p)


def _inner(h, w):
    return torch.tanh(h @ w).sin()


def _around_region(x, w):
    return remat(_inner, policy="save_matmuls")(x, w).cos() * 2


def _region_of_intermediate(x, w):
    return remat(_inner, policy="save_matmuls")(x.exp(), w).cos() * 2


@pytest.mark.parametrize("fn", [_around_region, _region_of_intermediate])
def test_saved_residuals_of_function_containing_regions(fn):
    """Regions report their inputs and kept values, plain ops their saves; bytes agree."""
    gen = torch.Generator().manual_seed(4)
    x, w = _randn(gen, 6, 5).requires_grad_(), _randn(gen, 5, 5).requires_grad_()
    records = saved_residuals(fn, x, w)
    kinds = collections.Counter((r.kind, r.op) for r in records)
    assert kinds[("saved", aten.mm.default)] == 1  # the region's mm; tanh's input
    assert kinds[("saved", aten.sin.default)] == 1  # the region's output, saved by cos outside it
    assert sum(r.nbytes for r in records if r.kind != "input") == _held(fn, x, w)


def test_print_saved_residuals_table(capsys):
    """One aligned row per residual under a header, then the total and the non-input total."""
    args = _small_named()
    fn = remat(_named, policy=save_names("h"))
    records = saved_residuals(fn, *args)
    print_saved_residuals(fn, *args)
    header, *rows, total = capsys.readouterr().out.splitlines()
    assert header.split() == ["kind", "bytes", "tensor", "name", "source"]
    assert len(rows) == len(records) == 4
    column = header.index("source")
    for row, r in zip(rows, records, strict=True):
        assert row.split()[:2] == [r.kind, str(r.nbytes)]
        assert row[column:] == r.source
        assert f"{str(r.dtype).removeprefix('torch.')}{list(r.shape)} on cpu" in row
        assert row.split()[-len(r.source.split()) - 1] == (r.name or "-")
    inputs = sum(r.nbytes for r in records if r.kind == "input")
    assert total == f"total: {inputs + 336} bytes (336 bytes besides inputs)"


# 7. Offload -----------------------------------------------------------------------------------


def test_offload_on_cpu_lists_offloaded_values_and_matches_plain():
    """offload(save_matmuls) on CPU: save_matmuls' values as "offloaded" on cpu, same bytes."""
    x, p = _tokens(), _layer(0)
    saved = saved_residuals(remat(_block, policy="save_matmuls"), x, p)
    offloaded = saved_residuals(remat(_block, policy=offload(policies.save_matmuls)), x, p)
    assert [r.kind for r in offloaded].count("offloaded") == 5
    assert offloaded == [
        r if r.kind == "input" else dataclasses.replace(r, kind="offloaded", device=CPU)
        for r in saved
    ]
    assert _held(remat(_block, policy=offload("save_matmuls")), x, p) == _held(
        remat(_block, policy="save_matmuls"), x, p
    )
    assert_tree_equal(
        _eager_grad(remat(_block, policy=offload("save_matmuls"))), _eager_grad(_block)
    )


def _scaled_then_batched(x: torch.Tensor) -> torch.Tensor:
    """SDPA's math path in small: a transposed product, expanded and reshaped (a copy of a
    transposed tensor, a view of a contiguous one)."""
    scaled = x.transpose(-1, -2) * 0.5
    batched = scaled.expand(scaled.shape).reshape(-1, *scaled.shape[-2:])
    return batched.sin().sum()


def test_offloaded_value_keeps_its_strides():
    """A kept value comes back from the offload device with its strides, so the ops that
    read it run what they ran in the forward (a contiguous copy made ``reshape`` a view:
    "rebuilt 4 of the 11 values" on GPT-2's SDPA attention with dropout)."""
    x = torch.randn(2, 3, 4, 5, requires_grad=True)
    f = remat(_scaled_then_batched, policy=offload(policies.save_ops(aten.mul)))
    assert [r.kind for r in saved_residuals(f, x)].count("offloaded") == 1
    assert_tree_equal(torch.autograd.grad(f(x), x), torch.autograd.grad(_scaled_then_batched(x), x))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda_frees_device_memory_until_backward():
    """On CUDA, offload(save_matmuls) holds less device memory after forward; same grads."""

    def run(block):
        gen = torch.Generator().manual_seed(5)
        x = _randn(gen, 8, 256, 64, dtype=torch.float32).cuda().requires_grad_()
        layers = [
            {
                k: v.detach().cuda().requires_grad_()
                for k, v in _layer(s, 64, 256, torch.float32).items()
            }
            for s in range(3)
        ]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = _stack(block, x, layers)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before - _nbytes(out)
        leaves = [x, *(v for p in layers for v in p.values())]
        grads = torch.autograd.grad(out.square().sum(), leaves)
        return held, (out, grads)

    _, plain = run(_block)  # first: cuBLAS workspaces count in memory_allocated
    held_offload, result = run(remat(_block, policy=offload("save_matmuls")))
    held_device, _ = run(remat(_block, policy="save_matmuls"))
    print(f"\nCUDA bytes held after forward: save_matmuls {held_device}, offloaded {held_offload}")
    assert held_offload < held_device
    assert_tree_equal(result, plain)


# 8. Against torch's selective activation checkpointing ----------------------------------------

SAC_SAVE = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _sac_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def test_save_matmuls_holds_no_more_than_torch_selective_checkpoint():
    """On a pre-LN attention+MLP block remat save_matmuls holds <= torch SAC, plain's grads."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
    p = _layer(6, d=64, hidden=256, dtype=torch.float32)
    x = _randn(torch.Generator().manual_seed(7), 4, 32, 64, dtype=torch.float32)
    x.requires_grad_()
    block = functools.partial(_block, heads=4)

    def sac(x, p):
        return checkpoint(block, x, p, use_reentrant=False, context_fn=context_fn)

    held_sac = _held(sac, x, p)
    held_remat = _held(remat(block, policy="save_matmuls"), x, p)
    print(f"\nbytes held after forward: torch SAC {held_sac}, remat save_matmuls {held_remat}")
    assert held_remat <= held_sac

    def grads(f):
        out = f(x, p)
        return out, torch.autograd.grad(out.square().sum(), [x, *p.values()])

    assert_tree_equal(grads(remat(block, policy="save_matmuls")), grads(block))


# 9. Errors ------------------------------------------------------------------------------------


def test_unknown_policy_name_lists_all_names():
    """An unknown policy name raises ValueError listing the four names."""
    message = (
        "`remat`: unknown policy 'save_matmul'. Valid names: 'save_everything', "
        "'save_matmuls', 'save_matmuls_no_batch', 'save_nothing'. Pass one of these, or a "
        "policy object from `remat.policies`."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        remat(_block, policy="save_matmul")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        offload("save_matmul")


@pytest.mark.parametrize("policy", [3, None, torch.ops.aten.mm.default.__class__])
def test_policy_of_wrong_type_raises_type_error(policy):
    """A policy that is no name, policy object or callable raises TypeError, also in p | q."""
    message = (
        "`remat`: `policy` must be a policy name (str), a policy object from `remat.policies`, "
        f"or a callable taking an `OpCall`; got {policy!r} of type {type(policy).__name__}."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        remat(_block, policy=policy)
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        policies.save_matmuls | policy
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        offload(policy)


@pytest.mark.parametrize("op", ["mm", torch.mm, 3])
def test_save_ops_rejects_non_ops(op):
    """save_ops takes aten OpOverloads or packets only."""
    message = f"`save_ops` takes aten ops such as `torch.ops.aten.mm`, got {op!r}."
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        save_ops(aten.mm, op)


@pytest.mark.parametrize("factory", [save_names, save_all_but_names])
def test_name_policies_reject_non_str_names(factory):
    """save_names and save_all_but_names take str names only."""
    message = f"`{factory.__name__}` takes names (str), got 3."
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        factory("h", 3)


def test_name_rejects_non_str_name():
    """remat.name(tree, 3) raises TypeError."""
    with pytest.raises(TypeError, match=r"^`remat.name`: `name` must be a str, got 3\.$"):
        name({"a": torch.ones(2)}, 3)


def _policy_returning(result):
    def keep_mm(call):
        return result if call.op is aten.mm.default else False

    return keep_mm


def _bad_result_message(result):
    return re.escape(
        "`remat`: a policy must return a bool or a `remat.policies.Decision`, but "
        f"keep_mm returned {result!r} for aten.mm.default."
    )


@pytest.mark.parametrize("result", [1, 0.5, None, "save"])
def test_custom_policy_returning_non_decision_raises_naming_it(result):
    """A custom policy returning neither bool nor Decision raises TypeError naming it."""
    x = torch.ones(2, 2, requires_grad=True)
    with pytest.raises(TypeError, match=f"^{_bad_result_message(result)}$"):
        remat(lambda x: torch.mm(x, x).sin(), policy=_policy_returning(result))(x)


def test_custom_policy_error_survives_tensor_operators():
    """The policy's TypeError reaches the caller when the op runs from an operator (``@``)."""
    # Tensor.__matmul__ turns a TypeError raised inside it into NotImplemented, so Python
    # reports "unsupported operand type(s) for @" unless remat raises outside the op.
    x = torch.ones(2, 2, requires_grad=True)
    with pytest.raises(TypeError, match=f"^{_bad_result_message(1)}$"):
        remat(lambda x: (x @ x).sin(), policy=_policy_returning(1))(x)


# Regressions found while writing these tests ---------------------------------------------------


def test_kept_value_modified_in_place_later_is_not_replayed_modified():
    """A kept mm output modified in place after use is replayed with its value at the time."""

    def fn(x, w):
        y = x @ w
        s = y.exp()
        y.mul_(2)
        return s * y

    gen = torch.Generator().manual_seed(8)
    args = (_randn(gen, 3, 3).requires_grad_(), _randn(gen, 3, 3).requires_grad_())
    expected = torch.autograd.grad(fn(*args).sum(), args)
    assert_tree_equal(
        torch.autograd.grad(remat(fn, policy="save_matmuls")(*args).sum(), args), expected
    )


def test_name_does_not_shift_kept_values():
    """Tagging a kept value leaves the op indices of later kept values aligned."""

    def fn(x, w):
        h = name(torch.tanh(x @ w), "h")
        return (h @ w).exp()

    gen = torch.Generator().manual_seed(9)
    args = (_randn(gen, 3, 3).requires_grad_(), _randn(gen, 3, 3).requires_grad_())
    policy = policies.save_matmuls | save_names("h")
    expected = torch.autograd.grad(fn(*args).sum(), args)
    assert_tree_equal(torch.autograd.grad(remat(fn, policy=policy)(*args).sum(), args), expected)


def test_kept_value_rebuilt_last_under_func_grad():
    """Under torch.func.grad, a kept value that is the last one the recompute rebuilds works."""
    # exp saves its output, which the policy keeps: the recompute ends on a replayed value.
    f = remat(torch.exp, policy=save_ops(aten.exp))
    x = torch.linspace(-1, 1, 5, dtype=DTYPE)
    assert_tree_equal(torch.func.grad(lambda x: f(x).sum())(x), x.exp())


def test_offloaded_value_under_func_grad():
    """Under torch.func.grad, an offloaded value is brought back for the recompute."""
    f = remat(lambda x: x.exp().tanh(), policy=offload(save_ops(aten.exp)))
    x = torch.linspace(-1, 1, 5, dtype=DTYPE)
    expected = torch.func.grad(lambda x: x.exp().tanh().sum())(x)
    assert_tree_equal(torch.func.grad(lambda x: f(x).sum())(x), expected)


# 9. Programs: later forwards follow the first ------------------------------------------------


class _Branchy(torch.nn.Module):
    """Data-dependent control flow after a shared start: ``deep`` adds a product."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor, deep: bool) -> torch.Tensor:
        h = torch.tanh(x @ self.w)
        if deep:
            h = torch.sigmoid(h @ self.w)
        return (h.sin() * h).sum()


@pytest.mark.parametrize("policy", ["save_matmuls", offload(save_ops(aten.mm))])
def test_later_forwards_follow_the_program_and_leave_it_where_it_differs(monkeypatch, policy):
    """The second forward of the same program records no op (it follows the first); a
    forward that differs records from the op where it left the program, keeps what the
    policy keeps there, and gives plain's gradients; the next one follows the new program."""
    from remat import _keep

    recorded: list[str] = []
    after = _keep.Keeper.after

    def counting(self: Any, op: Any, *rest: Any) -> None:
        recorded.append(str(op.func.overloadpacket))
        after(self, op, *rest)

    monkeypatch.setattr(_keep.Keeper, "after", counting)
    torch.manual_seed(0)
    model = _Branchy()
    f = remat(model, policy=policy)
    x = torch.randn(6, 6, requires_grad=True)
    counts = []
    for deep in (False, False, True, True, False):
        recorded.clear()
        got = torch.autograd.grad(f(x, deep), (x, model.w))
        assert_tree_equal(got, torch.autograd.grad(model(x, deep), (x, model.w)))
        kept = saved_residuals(f, x, deep)
        assert [str(r.op.overloadpacket) for r in kept if r.op is not None] == ["aten.mm"] * (
            1 + deep
        )
        counts.append(len(recorded))
    recorded.clear()
    remat(_Branchy(), policy=policy)(x, True)  # a first forward of the deep program
    deep = len(recorded)
    first, followed, left, followed_deep, back = counts
    assert first > 0
    assert followed == followed_deep == 0
    assert left == deep - 2  # from the op after the shared start (`mm`, `tanh`)
    assert back == first - 2


class _SinMatmul(torch.nn.Module):
    """``tanh(sin(x) @ w)`` with a frozen ``w``: autograd saves tanh's output, not the
    product's inputs, so the recompute needs ``sin`` only where it runs ``mm`` again."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x.sin() @ self.w)


def test_a_program_remembers_what_each_recompute_runs_by_the_values_it_keeps():
    """What a recompute must run is remembered per program, by the values rebuilt and kept:
    a second backward through the same graph (the kept product let go) runs ``sin`` and
    ``mm`` again, where the first backward replayed the product and skipped ``sin``."""
    from remat import _modules

    torch.manual_seed(0)
    model = _SinMatmul()
    f = remat(model, policy="save_matmuls")
    x = torch.randn(6, 6, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), x)
    for _ in range(2):  # the second call follows the program of the first
        out = f(x).sum()
        assert_tree_equal(torch.autograd.grad(out, x, retain_graph=True), expected)
        assert_tree_equal(torch.autograd.grad(out, x), expected)
    (program,) = _modules.programs(model).values()
    ops = [str(op.overloadpacket) for op in program.ops]
    sin, mm = ops.index("aten.sin"), ops.index("aten.mm")
    runs = {bool(kept): needed for (_, _, kept, _), (needed, _) in program.needs.items()}
    assert mm in runs[True]
    assert sin not in runs[True]
    assert {sin, mm} <= runs[False]

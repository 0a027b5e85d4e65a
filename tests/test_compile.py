"""Regions under `torch.compile`: traced into one graph, policies honoured by the partitioner."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat import policies

aten = torch.ops.aten
DTYPE = torch.float64
WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, dtype=DTYPE)
        self.up = nn.Linear(WIDTH, 4 * WIDTH, dtype=DTYPE)
        self.down = nn.Linear(4 * WIDTH, WIDTH, dtype=DTYPE)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, wrap) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.wrap(block)(x)
        return x.square().mean()


def _plain(block):
    return block


def _torch_checkpoint(block):
    return functools.partial(torch.utils.checkpoint.checkpoint, block, use_reentrant=False)


def _sac(block):
    def decide(ctx, op, *args, **kwargs):
        keep = op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, decide)
    return functools.partial(
        torch.utils.checkpoint.checkpoint, block, use_reentrant=False, context_fn=context
    )


def _model(wrap):
    torch.manual_seed(0)
    return Stack(wrap)


def _steps(model, steps=3):
    """Loss and gradients of ``steps`` compiled steps (fullgraph, no recompile after the first)."""
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    history = []
    for step in range(steps):
        x = torch.randn(8, WIDTH, dtype=DTYPE, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(100 + step)
        model.zero_grad(set_to_none=True)
        if step == 1:
            torch._dynamo.config.error_on_recompile = True
        try:
            loss = compiled(x)
        finally:
            torch._dynamo.config.error_on_recompile = False
        loss.backward()
        history.append((loss.detach(), [p.grad for p in model.parameters()]))
    return history


def _saved_bytes(model) -> int:
    """Bytes the compiled forward saves for backward (AOTAutograd saves through autograd)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, WIDTH, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(x)
    loss.backward()
    return sum(storages.values())


def _by_op(call):
    return call.op in (aten.addmm.default,)


POLICIES = {
    "save_nothing": "save_nothing",
    "save_matmuls": "save_matmuls",
    "save_matmuls_no_batch": "save_matmuls_no_batch",
    "save_ops": policies.save_ops(aten.addmm),
    "offload": policies.offload("save_matmuls"),
    "callable": _by_op,
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_compiled_steps_equal_compiled_plain(policy):
    """fullgraph compiles (no graph break), steps 2 and 3 do not recompile, and loss and
    gradients are bitwise compiled plain's, dropout on."""
    expected = _steps(_model(_plain))
    got = _steps(_model(remat.remat(policy=policy)))
    for (loss, grads), (plain_loss, plain_grads) in zip(got, expected, strict=True):
        assert torch.equal(loss, plain_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


def test_compiled_regions_save_what_compiled_checkpoint_and_sac_save():
    """save_nothing saves what compiled torch.utils.checkpoint saves, save_matmuls what
    compiled SAC saves. (On blocks this small the partitioner already recomputes much of
    plain's: SAC and save_matmuls save a little more than plain, and so would torch's.)"""
    plain = _saved_bytes(_model(_plain))
    nothing = _saved_bytes(_model(remat.remat))
    matmuls = _saved_bytes(_model(remat.remat(policy="save_matmuls")))
    assert nothing <= _saved_bytes(_model(_torch_checkpoint))
    assert matmuls <= _saved_bytes(_model(_sac))
    assert nothing < plain
    assert nothing < matmuls


def test_compiled_apply_and_checkpoint_trace_too():
    expected = _steps(_model(_plain), steps=1)
    applied = remat.apply(_model(_plain), Block, policy="save_matmuls")
    wrapped = _model(lambda block: functools.partial(remat.checkpoint, block))
    for model in (applied, wrapped):
        ((loss, grads),) = _steps(model, steps=1)
        assert torch.equal(loss, expected[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, expected[0][1], strict=True))


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (policies.save_names("h"), "tagged with `remat.name`"),
        (policies.save_matmuls | policies.save_all_but_names("h"), "tagged with `remat.name`"),
        (lambda call: call.output.numel() > 8, "`OpCall.output` does not exist"),
    ],
)
def test_policies_the_trace_cannot_answer_raise_naming_remat(policy, message):
    """Never a silent fall back to save_nothing, and never a RecomputeError."""
    model = _model(remat.remat(policy=policy))
    with pytest.raises(Exception, match=message):
        _steps(model, steps=1)


# Compiled autograd itself reads `.grad` of non-leaf tensors while it traces (torch 2.13).
NON_LEAF_GRAD = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not")


def _compiled_autograd_backward(model):
    """Loss and gradients of one eager forward whose backward compiled autograd runs."""
    from torch._dynamo import compiled_autograd

    x = torch.randn(8, WIDTH, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(100)
    loss = model(x)
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@NON_LEAF_GRAD
def test_eager_regions_under_compiled_autograd_give_plain_gradients():
    """The default policy's unpack hooks run under compiled autograd: eager plain's
    gradients, each block recomputed once."""
    calls = []

    def counted(block):
        def run(x):
            calls.append(1)
            return block(x)

        return remat.remat(run)

    loss, grads = _compiled_autograd_backward(_model(counted))
    plain_loss, plain_grads = _compiled_autograd_backward(_model(_plain))
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert len(calls) == 6  # 3 forwards and 3 recomputes


@NON_LEAF_GRAD
def test_per_op_policy_under_compiled_autograd_raises_naming_it():
    with pytest.raises(remat.RecomputeError, match=r"save_matmuls.*compiled autograd"):
        _compiled_autograd_backward(_model(remat.remat(policy="save_matmuls")))

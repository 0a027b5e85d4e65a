"""`remat.apply`, `remat.unapply` and `remat.checkpoint`: models, copies and torch's call."""

from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import remat
from remat import policies

DTYPE = torch.float64


class _Runs:
    """How many times a forward ran, counted where remat does not restore state (an
    attribute of an object that is not a module): a module's own int attribute is the
    forward's in each recompute, and plain's after it."""

    def __init__(self) -> None:
        self.count = 0


class Block(nn.Module):
    """A residual block with a batch norm (a buffer the forward updates) and dropout."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width, dtype=DTYPE)
        self.norm = nn.BatchNorm1d(2 * width, dtype=DTYPE)
        self.down = nn.Linear(2 * width, width, dtype=DTYPE)
        self.drop = nn.Dropout(0.2)
        self.runs = _Runs()  # forward runs: the forward, then one recompute per backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.count += 1
        return x + self.drop(self.down(torch.tanh(self.norm(self.up(x)))))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 1, dtype=DTYPE))


def _train(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    """Losses of ``steps`` SGD steps on fixed data and dropout masks."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(16, 8, dtype=DTYPE)
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _calls(model: nn.Module) -> list[int]:
    return [m.runs.count for m in model.modules() if isinstance(m, Block)]


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize(
    "policy", ["save_nothing", "save_matmuls", policies.offload("save_matmuls")]
)
def test_apply_trains_bitwise_like_plain_and_keeps_names(policy):
    plain, model = _model(), _model()
    names = [name for name, _ in model.named_parameters()]
    assert remat.apply(model, Block, policy=policy) is model
    assert [name for name, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == list(plain.state_dict())
    assert torch.equal(torch.stack(_train(model)), torch.stack(_train(plain)))
    _assert_same_state(model, plain)
    assert _calls(model) == [6, 6]  # 3 forwards and 3 recomputes each
    assert _calls(plain) == [3, 3]


def test_apply_where_forms_pick_the_same_modules():
    by_class = remat.apply(_model(), Block)
    by_tuple = remat.apply(_model(), (Block, nn.Identity))
    by_name = remat.apply(_model(), lambda name, _: name in ("0", "1"))
    root = remat.apply(_model())
    for model in (by_class, by_tuple, by_name):
        _train(model, 1)
        assert _calls(model) == [2, 2]
    _train(root, 1)
    assert _calls(root) == [2, 2]  # the whole model is one region
    assert "forward" in root.__dict__
    assert "forward" not in root[0].__dict__  # a match inside a match is left alone


def test_apply_rejects_bad_arguments_naming_them():
    with pytest.raises(TypeError, match=r"`model` must be an nn\.Module"):
        remat.apply(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`where` must be None"):
        remat.apply(_model(), int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got a module instance, Linear.*`where=Linear`"):
        remat.apply(_model(), nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match=r"where=Conv1d` matches no submodule.*BatchNorm1d, Block, Dropout, Linear"
    ):
        remat.apply(_model(), nn.Conv1d)
    with pytest.raises(ValueError, match="unknown policy 'save_all'"):
        remat.apply(_model(), Block, policy="save_all")


def test_deepcopy_of_applied_model_is_independent_and_rematerializes():
    """A forward patched with a bound method would send the copy's gradients to the original."""
    model = remat.apply(_model(), Block, policy="save_matmuls")
    twin = copy.deepcopy(model)
    plain = _model()
    assert torch.equal(torch.stack(_train(twin)), torch.stack(_train(plain)))
    _assert_same_state(twin, plain)
    assert all(p.grad is None for p in model.parameters())  # the original was not touched
    _assert_same_state(model, _model())
    assert _calls(twin) == [6, 6]


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_saved_and_loaded_model_is_independent_and_rematerializes(how):
    model = remat.apply(_model(), Block, policy="save_matmuls")
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    plain = _model()
    assert torch.equal(torch.stack(_train(loaded)), torch.stack(_train(plain)))
    _assert_same_state(loaded, plain)
    assert all(p.grad is None for p in model.parameters())
    assert _calls(loaded) == [6, 6]
    assert loaded[0].forward.options["policy"] is policies.save_matmuls


def test_apply_twice_equals_once_and_unapply_undoes_it():
    once = remat.apply(_model(), Block)
    twice = remat.apply(remat.apply(_model(), Block), Block)
    assert torch.equal(torch.stack(_train(once)), torch.stack(_train(twice)))
    assert _calls(once) == _calls(twice) == [6, 6]
    undone = remat.unapply(twice)
    assert all("forward" not in m.__dict__ for m in undone.modules())
    _train(undone, 1)
    assert _calls(undone) == [7, 7]  # one forward, no recompute


def test_apply_keeps_a_forward_set_on_the_instance_and_unapply_restores_it():
    model = _model()
    block = model[0]
    seen = []

    def traced(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape)
        return Block.forward(block, x)

    block.forward = traced
    remat.apply(model, Block)
    _train(model, 1)
    assert len(seen) == 2  # the forward and the recompute both ran the instance's forward
    remat.unapply(model)
    assert block.forward is traced


def test_checkpoint_is_a_drop_in_for_torch_checkpoint():
    x = torch.randn(4, 8, dtype=DTYPE, requires_grad=True)
    w = torch.randn(8, 8, dtype=DTYPE, requires_grad=True)

    def fn(x, w, *, scale):
        return torch.tanh(x @ w).sin() * scale

    ours = remat.checkpoint(fn, x, w, scale=2.0, preserve_rng_state=False, early_stop=False)
    theirs = torch.utils.checkpoint.checkpoint(fn, x, w, scale=2.0, use_reentrant=False)
    assert torch.equal(ours, theirs)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            torch.autograd.grad(ours.sum(), (x, w)),
            torch.autograd.grad(theirs.sum(), (x, w)),
            strict=True,
        )
    )
    kept = remat.saved_residuals(
        functools.partial(remat.checkpoint, fn, policy="save_matmuls"), x, w, scale=2.0
    )
    assert "saved" in [r.kind for r in kept]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"use_reentrant": True}, "use_reentrant=True"),
        ({"context_fn": lambda: (None, None)}, "pass `policy=` instead"),
        ({"determinism_check": "strict"}, "'default' or 'none'"),
    ],
)
def test_checkpoint_rejects_torch_options_it_does_not_emulate(options, message):
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match=message):
        remat.checkpoint(torch.sin, x, **options)


def test_checkpoint_takes_torchs_default_context_fn():
    """``context_fn=noop_context_fn``, torch's default written out, is accepted (it was
    refused as a selective checkpointing context: found by a probe)."""
    x = torch.linspace(-1, 1, 4, dtype=torch.float64, requires_grad=True)
    out = remat.checkpoint(torch.sin, x, context_fn=torch.utils.checkpoint.noop_context_fn)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], x.detach().cos())


def test_checkpoint_debug_shows_both_op_sequences_on_divergence():
    calls = []

    def fn(x):
        calls.append(1)
        return x.exp().sin() if len(calls) == 1 else x.repeat(2).exp().sin()

    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(fn, x, debug=True)
    with pytest.raises(remat.RecomputeError, match="forward \\| recompute"):
        out.sum().backward()


def test_checkpoint_as_checkpoint_fn_of_torch_checkpoint_wrapper():
    plain, model = _model(), _model()
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_fn=remat.checkpoint)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block)
    )
    assert torch.equal(torch.stack(_train(model)), torch.stack(_train(plain)))
    assert _calls(model) == [6, 6]
    for (_, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a, b)

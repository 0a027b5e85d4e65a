"""Writes that only one run makes: the recompute's verified replay tells harmless ones apart.

FSDP2 re-gathers a unit's parameters wherever its state says: in the forward, in a
prefetch outside the region, or in the recompute. So a recompute may write memory the
forward never wrote. A write into memory the recompute itself just allocated, and FSDP2's
own re-gathering (its ``fsdp`` ops), leave every value matched ops read as the forward
had it; a write to memory from before the recompute raises.
"""

from __future__ import annotations

import pytest
import torch

from remat import RecomputeError, policies, remat
from tests.helpers import assert_tree_equal

PER_OP = {
    "save_matmuls": "save_matmuls",
    "save_ops(mm)": policies.save_ops(torch.ops.aten.mm),
    "save_everything_and_save_ops(mm)": policies.save_everything
    & policies.save_ops(torch.ops.aten.mm),
}
each_policy = pytest.mark.parametrize("policy", PER_OP.values(), ids=PER_OP.keys())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _randn(seed, *shape):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)


def _run(block, wrap):
    x, w = _randn(0, 3, 4), _randn(1, 4, 4)
    out = wrap(block)(x, w)
    out.sum().backward()
    return out, x.grad, w.grad


def _scratch_in_recompute(x, w):
    h = torch.tanh(x @ w)
    if _in_backward():
        torch.empty(4, dtype=h.dtype).fill_(0)  # a buffer only the recompute makes and writes
    return (h @ w).sin()


def _regather_in_recompute(x, w):
    if _in_backward():  # FSDP2's copy-out, into the parameter the forward read: same values
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
            gathered = w.detach().clone().view(-1)
            torch.ops.fsdp.split_with_sizes_copy(gathered, [w.numel()], 0, out=[w.view(-1)])
    return (torch.tanh(x @ w) @ w).sin()


def _unknown_write_in_recompute(x, w):
    if _in_backward():  # writes the parameter without a version bump: remat cannot tell
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
            w.mul_(1.0)
    return (torch.tanh(x @ w) @ w).sin()


@each_policy
def test_write_into_memory_the_recompute_made(policy):
    """A recompute-only write into a buffer it allocated: plain's outputs and gradients."""
    expected = _run(_scratch_in_recompute, lambda f: f)
    assert_tree_equal(_run(_scratch_in_recompute, lambda f: remat(f, policy=policy)), expected)


@each_policy
def test_fsdp2_regathering_in_the_recompute(policy):
    """FSDP2's copy-out of re-gathered parameters in the recompute: plain's gradients."""
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    expected = _run(_regather_in_recompute, lambda f: f)
    assert_tree_equal(_run(_regather_in_recompute, lambda f: remat(f, policy=policy)), expected)


@each_policy
def test_unknown_write_to_what_the_forward_read_raises(policy):
    """A recompute-only write to a tensor the forward read, hidden from its version: raises,
    naming the op (a per-op policy's recompute refuses writes to memory from before it)."""
    with pytest.raises(RecomputeError, match=r"writes in place, with aten\.mul_"):
        _run(_unknown_write_in_recompute, lambda f: remat(f, policy=policy))

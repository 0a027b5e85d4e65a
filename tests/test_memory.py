"""`remat.memory.track` counts what storages hold, including storages that resize themselves."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import remat
from tests import helpers
from tests.helpers import BasicBlock


def test_storage_resize_is_counted():
    """A storage freed with resize_(0) and regrown with resize_(n) counts 0, then n bytes."""
    with remat.memory.track() as mem:
        t = torch.empty(64)
        storage = t.untyped_storage()
        storage.resize_(0)
        freed = mem.live
        storage.resize_(512)
    assert (freed, mem.live, mem.peak) == (0, 512, 512)


def test_storage_from_before_counts_once_regrown_inside():
    """A storage made before the context counts nothing until it regrows inside it."""
    t = torch.empty(64)
    with remat.memory.track() as mem:
        t.untyped_storage().resize_(0)
        freed = mem.live
        t.untyped_storage().resize_(256)
        regrown = mem.live
        t.untyped_storage().resize_(256)  # the same size: nothing reallocates
        same = mem.live
        del t
    assert (freed, regrown, same, mem.live) == (0, 256, 256, 0)


def test_fsdp2_free_and_gather_of_unsharded_parameters():
    """FSDP2's own free_storage and alloc_storage (how it reshards and unshards) are seen."""
    fsdp_param = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_param")
    unsharded = torch.empty(32, 8)  # allocated before the context, as after a first step
    with remat.memory.track() as mem:
        fsdp_param.free_storage(unsharded)
        after_free = mem.live
        fsdp_param.alloc_storage(unsharded)
        after_gather = mem.live
        fsdp_param.free_storage(unsharded)
    assert (after_free, after_gather, mem.live, mem.peak) == (0, 1024, 0, 1024)


def test_tensor_resize_and_growing_out_argument_are_counted():
    """Tensor.resize_ and an out= argument that grows allocate; in-place ops do not."""
    with remat.memory.track() as mem:
        t = torch.empty(0)
        t.resize_(16)
        resized = mem.live
        out = torch.empty(0)
        torch.add(t, t, out=out)
        grown = mem.live
        t.add_(1)
        in_place = mem.live
        del t, out
    assert (resized, grown, in_place, mem.live) == (64, 128, 128, 0)


def test_resizes_outside_the_context_are_not_counted():
    """Once the context exits, resizes change nothing it reports."""
    with remat.memory.track() as mem:
        t = torch.empty(8)
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(4096)
    assert mem.live == 32


def test_nested_trackers_both_see_a_resize():
    """Each active tracker counts a storage's resize."""
    with remat.memory.track() as outer, remat.memory.track() as inner:
        t = torch.empty(4)
        t.untyped_storage().resize_(64)
    assert (outer.live, inner.live) == (64, 64)
    del t


def _held_and_state(blocks: torch.nn.Module, wrap: Any, x: torch.Tensor) -> tuple[int, Any]:
    """Bytes held after the forward of ``blocks`` with each block under ``wrap``; then
    the gradients and buffers after its backward."""
    with remat.memory.track() as mem:
        h = x
        for block in blocks:
            h = wrap(block)(h)
        live = mem.live
        h.sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    return live, (grads, [b.clone() for b in blocks.buffers()])


def _checkpointed(block: torch.nn.Module) -> Any:
    return lambda h: torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)


@pytest.mark.parametrize("policy", helpers.POLICIES.values(), ids=helpers.POLICIES.keys())
def test_batch_norm_regions_hold_what_torch_checkpoint_holds_and_the_statistics(policy):
    """A region with batch norms in training holds one copy of their running statistics
    (and count of batches) as the forward began, which its recompute writes into them for
    its run and then gives back what they held (it wrote scratch memory, and held nothing
    more, but a read of the statistic that remat did not see read the update). So ResNet's
    BasicBlocks under save_nothing hold what torch.utils.checkpoint holds and those bytes,
    and every step trains bitwise as plain (torch's checkpoint updates the statistics
    twice)."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(BasicBlock(), BasicBlock())
    plain = copy.deepcopy(blocks)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    wrap = functools.partial(remat.remat, policy=policy)
    for _ in range(3):  # the first call learns what the forward updates
        held, got = _held_and_state(blocks, wrap, x)
        _, expected = _held_and_state(plain, lambda f: f, x)
        helpers.assert_tree_equal(got, expected)
        for model in (blocks, plain):
            model.zero_grad()
    if policy == "save_nothing":
        checkpointed = copy.deepcopy(blocks)
        statistics = sum(b.numel() * b.element_size() for b in blocks.buffers())
        assert held == _held_and_state(checkpointed, _checkpointed, x)[0] + statistics


class _Watching(torch.nn.Module):
    """Reads its batch norm's running mean besides batch norm as ``reads`` says (None: not
    at all); its metadata, always."""

    def __init__(self, reads: str | None = None) -> None:
        super().__init__()
        self.bn, self.reads = torch.nn.BatchNorm1d(4), reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.bn.running_mean
        if mean.shape != (4,) or mean.device != x.device or mean.dim() != 1:
            raise ValueError(mean.shape)
        out = self.bn(x)
        if self.reads == "argument":  # the statistic read as a value, which the backward needs
            out = out * mean.exp()
        elif self.reads == "in-a-list":
            out = out * torch.stack([mean, mean]).sum(0)
        elif self.reads == "saved":  # the product saves the statistic itself
            out = out * mean
        elif self.reads == "batch-norm-in-eval":  # batch norm's own kernel reads it
            out = out + F.batch_norm(x, mean, self.bn.running_var, training=False)
        return out.sin()


@pytest.mark.parametrize("reads", ["argument", "saved", "batch-norm-in-eval"])
@pytest.mark.parametrize("policy", helpers.POLICIES.values(), ids=helpers.POLICIES.keys())
def test_a_statistic_read_besides_batch_norm_is_kept(policy, reads):
    """A forward that reads batch norm's running mean as a value (also through batch norm in
    evaluation, which gave scratch memory's values from the second call on; or saved as it
    is, after a policy kept batch norm's output, which left the recompute's copy of the
    statistic as it was before the update): its first (watched) call sees the read, and the
    recompute reads the kept value: bitwise plain's, no error."""
    torch.manual_seed(0)
    model, plain = _Watching(reads), _Watching(reads)
    plain.load_state_dict(model.state_dict())
    f = remat.remat(model, policy=policy)
    x = torch.randn(6, 4, requires_grad=True)
    for _ in range(3):
        got = torch.autograd.grad(f(x).sum(), (x, *model.parameters()))
        expected = torch.autograd.grad(plain(x).sum(), (x, *plain.parameters()))
        helpers.assert_tree_equal((got, list(model.buffers())), (expected, list(plain.buffers())))


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReadsThroughABox(torch.nn.Module):
    """Reads its batch norm's running mean through a plain object, before the norm, from
    the call ``reads`` turns it on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bn, self.reads = torch.nn.BatchNorm1d(4), False
        self.box = _Box(self.bn.running_mean)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1 + self.box.t.sum() if self.reads else 1
        return (self.bn(x) * scale).sin()


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_a_statistic_first_read_through_an_object_in_a_later_call_trains_as_plain(policy):
    """A statistic first read in a later call through a plain object (where remat does not
    look): the recompute reads it rewound in place, as the forward read it. It read the
    updated statistic there, and the gradients differed from plain's with no error."""
    model, plain = _ReadsThroughABox(), _ReadsThroughABox()
    f = remat.remat(model, policy=policy)
    x = torch.randn(6, 4, requires_grad=True)
    for _ in range(3):
        f(x).sum().backward()
        plain(x).sum().backward()
    model.reads = plain.reads = True
    for _ in range(2):
        got = torch.autograd.grad(f(x).sum(), (x, *model.parameters()))
        expected = torch.autograd.grad(plain(x).sum(), (x, *plain.parameters()))
        helpers.assert_tree_equal((got, list(model.buffers())), (expected, list(plain.buffers())))


@pytest.mark.parametrize("reads", ["argument", "in-a-list", "batch-norm-in-eval"])
@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_a_statistic_first_read_in_a_later_call_trains_as_plain(policy, reads):
    """A statistic read besides batch norm only from a later call on (data-dependent): the
    recompute reads it rewound in place, as the forward read it: plain's from that call on
    (the recompute wrote scratch memory, and that call raised)."""
    torch.manual_seed(0)
    model, plain = _Watching(), _Watching()
    plain.load_state_dict(model.state_dict())
    f = remat.remat(model, policy=policy)
    x = torch.randn(6, 4, requires_grad=True)
    for _ in range(3):
        f(x).sum().backward()
        plain(x).sum().backward()
    model.reads = plain.reads = reads
    for _ in range(2):
        got = torch.autograd.grad(f(x).sum(), (x, *model.parameters()))
        expected = torch.autograd.grad(plain(x).sum(), (x, *plain.parameters()))
        helpers.assert_tree_equal((got, list(model.buffers())), (expected, list(plain.buffers())))

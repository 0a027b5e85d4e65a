"""`remat.memory.track` counts what storages hold, including storages that resize themselves."""

from __future__ import annotations

import pytest
import torch

import remat
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


def test_batch_norm_regions_hold_the_running_statistics_and_no_more():
    """docs/limitations.md: a region with batch norm in training holds, besides what
    torch.utils.checkpoint holds, its running statistics' values from before the forward
    (from its second call on, once it learned that the forward updates them)."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(BasicBlock(), BasicBlock())
    x = torch.randn(2, 4, 8, 8, requires_grad=True)

    def held(wrap) -> int:
        with remat.memory.track() as mem:
            h = x
            for block in blocks:
                h = wrap(block)(h)
            live = mem.live
            h.sum().backward()
        return live

    def checkpointed(block):
        return lambda h: torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)

    held(remat.remat)  # learns what the forward updates
    statistics = sum(
        t.untyped_storage().nbytes()
        for m in blocks.modules()
        if isinstance(m, torch.nn.BatchNorm2d)
        for t in (m.running_mean, m.running_var, m.num_batches_tracked)
    )
    assert held(remat.remat) == held(checkpointed) + statistics

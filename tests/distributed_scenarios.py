"""Training scenarios for ``tests/test_distributed.py``, run by each of its 2 gloo ranks.

Run as ``python distributed_scenarios.py RANK WORLD_SIZE INIT_FILE OUT_DIR``: the rank
joins a gloo group rendezvousing on ``INIT_FILE``, runs every scenario, and after each
one rewrites ``OUT_DIR/rank{RANK}.json`` with what it found, so a rank that hangs or
dies still reports the scenarios it finished.

Each scenario trains the same small model twice from the same initialization and data,
once as plain autograd and once rematerialized, and reports every loss, gradient and
parameter (the local shard under FSDP) that is not bitwise equal. The memory scenarios
report the bytes each block holds after the model's forward, with remat, with
``torch.utils.checkpoint`` and without either.
"""

from __future__ import annotations

import datetime
import functools
import json
import sys
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import remat

WIDTH, BATCH, BLOCKS, STEPS = 16, 8, 3, 2
TIMEOUT = datetime.timedelta(seconds=30)  # of each collective
WRAPPED = "_checkpoint_wrapped_module"  # in names under torch's checkpoint_wrapper


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm residual MLP; ``unused`` takes no part (for ``find_unused_parameters``)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(WIDTH), Mlp()
        self.unused = nn.Linear(WIDTH, WIDTH) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Gated(Block):
    """torchtitan's MoE layout: ``mlp`` (the experts) is sharded on its own, and ops after
    it save its output, so the region's recompute starts before the backward reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.mlp(h) * torch.sigmoid(self.gate(h))


class Stack(nn.Module):
    """``BLOCKS`` blocks, each called through ``wrap``, then a norm."""

    def __init__(self, block: type[Block], **options: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(**options) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.wrap: Callable[[nn.Module], Callable[..., Any]] = _same
        self.allocations: Allocations | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.allocations is not None:
                self.allocations.block = i
            x = self.wrap(block)(x)
        if self.allocations is not None:
            self.allocations.block = None
        return self.norm(x)


class Allocations(TorchDispatchMode):
    """The storages aten ops allocate during each block's call, but communication buffers.

    FSDP2's all-gather buffers are freed when gloo's threads let go of them, at a time
    that depends on the threads: a block's memory is what it keeps for the backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.block: int | None = None
        self.made: list[tuple[int, weakref.ref[Any]]] = []
        # Storages a collective or an FSDP2 op read: id -> ref (ids are reused once freed).
        self.communicated: dict[int, weakref.ref[Any]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.block is None:
            return out
        if func.namespace in ("c10d", "fsdp"):
            for t in [*args, *(kwargs or {}).values()]:
                for leaf in t if isinstance(t, (list, tuple)) else (t,):
                    if isinstance(leaf, torch.Tensor):
                        storage = leaf.untyped_storage()
                        self.communicated[id(storage)] = weakref.ref(storage)
        elif not func.is_view and not func._schema.is_mutable:
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.made.append((self.block, weakref.ref(t.untyped_storage())))
        return out

    def held(self) -> list[int]:
        """Per block, the bytes of the storages it allocated that are alive now."""
        alive: dict[int, Any] = {}
        for block, ref in self.made:
            storage = ref()
            communicated = self.communicated.get(id(storage))
            if storage is not None and (communicated is None or communicated() is not storage):
                alive[id(storage)] = (block, storage)
        held = [0] * BLOCKS
        for block, storage in alive.values():
            held[block] += storage.nbytes()
        return held


def _same(block: nn.Module) -> nn.Module:
    return block


class Normed(Block):
    """A batch norm in the block: its running statistics must be updated once."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.batch_norm(self.norm(x)))


def model(block: type[Block] = Block, dtype: torch.dtype = torch.float64, **kw: Any) -> Stack:
    torch.manual_seed(0)
    return Stack(block, **kw).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(BATCH, WIDTH, generator=generator, dtype=dtype)


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def train(
    net: nn.Module,
    micro: int = 1,
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor]:
    """``STEPS`` SGD steps of ``micro`` micro-batches each; every value worth comparing."""
    call = call or (lambda m, x: m(x))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=False)
    seen: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        for i in range(micro):
            if micro > 1:
                net.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
            loss = call(net, batch(micro * step + i, dtype)).float().square().mean()
            loss.backward()
            seen[f"step {step} loss {i}"] = loss.detach().clone()
        for name, p in net.named_parameters():
            if p.grad is not None:
                seen[f"step {step} grad {name}"] = local(p.grad)
        optimizer.step()
        optimizer.zero_grad()
    for name, p in net.named_parameters():
        seen[f"param {name}"] = local(p)
    for name, b in net.named_buffers():
        seen[f"buffer {name}"] = local(b)
    return {key.replace(f"{WRAPPED}.", ""): value for key, value in seen.items()}


def differences(plain: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> list[str]:
    if plain.keys() != other.keys():
        return [f"different values: {sorted(plain.keys() ^ other.keys())}"]
    return [k for k in plain if not torch.equal(plain[k], other[k])]


def blocks(net: nn.Module) -> list[nn.Module]:
    return [m for m in net.modules() if isinstance(m, Block)]


def mesh() -> Any:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def fsdp2(net: nn.Module, units: Callable[[Block], nn.Module], **options: Any) -> nn.Module:
    for block in blocks(net):
        fully_shard(units(block), mesh=mesh(), **options)
    fully_shard(net, mesh=mesh(), **options)
    return net


def apply_each(net: nn.Module, **options: Any) -> nn.Module:
    for block in blocks(net):
        remat.apply(block, **options)
    return net


def forward_attr(net: nn.Module) -> nn.Module:
    for block in blocks(net):
        block.forward = remat.remat(block.forward)  # type: ignore[method-assign]
    return net


# Scenarios ---------------------------------------------------------------------------------


def compare(build: Callable[[bool], nn.Module], **train_options: Any) -> dict[str, Any]:
    plain = train(build(False), **train_options)
    return {"differences": differences(plain, train(build(True), **train_options))}


def _ddp(use_remat: bool, **options: Any) -> nn.Module:
    net = model(unused=options.pop("unused", False))
    return DistributedDataParallel(apply_each(net) if use_remat else net, **options)


def _fsdp1(use_remat: bool) -> nn.Module:
    net = apply_each(model()) if use_remat else model()
    return FullyShardedDataParallel(
        net, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block})
    )


def _fsdp2(use_remat: bool, when: str, policy: str = "save_nothing", **options: Any) -> nn.Module:
    net = model(**options.pop("model", {}))
    if use_remat and when == "before":
        apply_each(net, policy=policy)
    fsdp2(net, lambda b: b, **options)
    if use_remat and when == "after":
        apply_each(net, policy=policy)
    if use_remat and when == "attribute":
        forward_attr(net)
    return net


def _nested(use_remat: bool, policy: str, block: type[Block] = Gated) -> nn.Module:
    """Each block's ``mlp`` is its own FSDP2 unit, inside the block's region."""
    net = model(block)
    if use_remat:
        apply_each(net, policy=policy)
    return fsdp2(net, lambda b: b.mlp)


def _around(policy: str) -> dict[str, Any]:
    """``remat(fully_shard(block))``: the FSDP2 unit's hooks run inside the region."""

    def build(use_remat: bool) -> nn.Module:
        net = model()
        if use_remat:
            net.wrap = functools.partial(remat.remat, policy=policy)
        return fsdp2(net, lambda b: b)

    return compare(build)


def _bf16(use_remat: bool) -> nn.Module:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _fsdp2(use_remat, "after", model={"dtype": torch.float32}, mp_policy=policy)


def _torchtitan(use_remat: bool) -> nn.Module:
    """torchtitan's MoE layout: ``checkpoint_wrapper(block, checkpoint_fn=remat.checkpoint)``,
    the experts sharded on their own, then the wrapped block."""
    net = model(Gated)
    checkpoint_fn = functools.partial(remat.checkpoint, policy="save_matmuls")
    for i, block in enumerate(list(net.blocks)):
        fully_shard(block.mlp, mesh=mesh())
        if use_remat:
            net.blocks[i] = checkpoint_wrapper(block, checkpoint_fn=checkpoint_fn)
        fully_shard(net.blocks[i], mesh=mesh())
    return fully_shard(net, mesh=mesh())


def _around_root(use_remat: bool) -> nn.Module:
    """``remat.apply`` on the root FSDP2 module: every unit's hooks run inside the region."""
    net = fsdp2(model(), lambda b: b)
    return remat.apply(net) if use_remat else net


def _step_between(use_remat: bool, when: str) -> dict[str, Any]:
    """An optimizer step between a forward and its backward: remat raises, plain does not."""
    net = model(Gated)
    if use_remat and when == "inside":
        apply_each(net)
    fsdp2(net, lambda b: b.mlp if when == "inside" else b)
    if use_remat and when == "around":
        net.wrap = remat.remat
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, foreach=False)
    net(batch(0)).square().mean().backward()
    loss = net(batch(1)).square().mean()
    optimizer.step()
    try:
        loss.backward()
    except RuntimeError as error:
        return {"raised": str(error)}
    return {"raised": None}


WRAPS: dict[str, Callable[[nn.Module], Callable[..., Any]]] = {
    "plain": _same,
    "checkpoint": lambda block: functools.partial(checkpoint, block, use_reentrant=False),
    "remat": remat.remat,
}


def _memory(setup: str) -> dict[str, Any]:
    """Bytes each block's call leaves alive (its output and what autograd keeps for it),
    measured by `remat.memory.track` in a second step, for each of `WRAPS`."""
    found: dict[str, Any] = {}
    for how, wrap in WRAPS.items():
        net = model(Gated)
        net.wrap = wrap
        if setup == "ddp":
            trained: nn.Module = DistributedDataParallel(net)
        else:
            trained = fsdp2(net, lambda b: b if setup == "fsdp2" else b.mlp)
        trained(batch(0)).square().mean().backward()
        with remat.memory.track() as meter, Allocations() as allocations:
            net.allocations = allocations
            loss = trained(batch(1)).square().mean()
            net.allocations = None
            held, after_forward = allocations.held(), meter.live
            meter.reset_peak()
            loss.backward()
        found[how] = {"held": held, "after forward": after_forward, "backward peak": meter.peak}
    return found


def _dtensor_dropout(policy: str) -> dict[str, Any]:
    """A region whose activations are DTensors (replicated, as tensor parallelism makes),
    with dropout: DTensor's dropout draws from the default generator whatever generator
    it is given, so a per-op policy's capture and replay lend it their states."""

    def block(x: Any, w: Any) -> Any:
        return F.dropout(torch.tanh(x @ w), 0.5).sin()

    found = {}
    for how, f in (("plain", block), ("remat", remat.remat(block, policy=policy))):
        torch.manual_seed(0)
        w = torch.nn.Parameter(distribute_tensor(torch.eye(WIDTH, dtype=torch.float64), mesh()))
        for step in range(STEPS):
            x = distribute_tensor(batch(step), mesh())
            f(x, w).sum().backward()
            found[f"{how} step {step} grad"] = local(w.grad)
        found[f"{how} generator"] = torch.get_rng_state()
    remat_found = {k.removeprefix("remat "): v for k, v in found.items() if k.startswith("remat")}
    plain_found = {k.removeprefix("plain "): v for k, v in found.items() if k.startswith("plain")}
    return {"differences": differences(plain_found, remat_found)}


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp": lambda: compare(_ddp),
    "ddp-static-graph": lambda: compare(functools.partial(_ddp, static_graph=True)),
    "ddp-find-unused": lambda: compare(
        functools.partial(_ddp, find_unused_parameters=True, unused=True)
    ),
    "fsdp1": lambda: compare(_fsdp1),
    "fsdp2-remat-before-shard": lambda: compare(functools.partial(_fsdp2, when="before")),
    "fsdp2-remat-after-shard": lambda: compare(functools.partial(_fsdp2, when="after")),
    "fsdp2-forward-attribute": lambda: compare(functools.partial(_fsdp2, when="attribute")),
    "fsdp2-save-matmuls": lambda: compare(
        functools.partial(_fsdp2, when="after", policy="save_matmuls")
    ),
    "fsdp2-no-reshard": lambda: compare(
        functools.partial(_fsdp2, when="after", reshard_after_forward=False)
    ),
    "fsdp2-bf16": lambda: compare(_bf16, dtype=torch.float32),
    "fsdp2-batch-norm": lambda: compare(
        functools.partial(_fsdp2, when="after", model={"block": Normed})
    ),
    "fsdp2-batch-norm-inside-region": lambda: compare(
        functools.partial(_nested, policy="save_nothing", block=Normed)
    ),
    "fsdp2-grad-accumulation": lambda: compare(functools.partial(_fsdp2, when="after"), micro=2),
    "fsdp2-unit-inside-region": lambda: compare(functools.partial(_nested, policy="save_nothing")),
    "fsdp2-unit-inside-region-save-matmuls": lambda: compare(
        functools.partial(_nested, policy="save_matmuls")
    ),
    "fsdp2-region-around-unit": lambda: _around("save_nothing"),
    "fsdp2-region-around-unit-save-matmuls": lambda: _around("save_matmuls"),
    "fsdp2-region-around-root": lambda: compare(_around_root),
    "fsdp2-torchtitan-moe-checkpoint-wrapper": lambda: compare(_torchtitan),
    "dtensor-dropout-save-nothing": lambda: _dtensor_dropout("save_nothing"),
    "dtensor-dropout-save-matmuls": lambda: _dtensor_dropout("save_matmuls"),
    "memory-ddp": lambda: _memory("ddp"),
    "memory-fsdp2": lambda: _memory("fsdp2"),
    "memory-fsdp2-unit-inside-region": lambda: _memory("fsdp2-unit-inside-region"),
    "fsdp2-step-between-forward-and-backward": lambda: {
        where: {"plain": _step_between(False, where), "remat": _step_between(True, where)}
        for where in ("inside", "around")
    },
}


def run(rank: int, world: int, init_file: str, out: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    try:
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = scenario()
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            (out / f"rank{rank}.json").write_text(json.dumps(results))
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, init_file, out = sys.argv[1:]
    run(int(rank), int(world), init_file, Path(out))

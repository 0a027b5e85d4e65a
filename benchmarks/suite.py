"""The benchmark suite: memory held and time paid, remat side by side with the alternatives.

Everything runs in one process. Memory is counted exactly with `remat.memory.track()`
on CPU (live bytes of tensor storages) or with the CUDA allocator on a GPU; times are
medians of interleaved rounds after warm-up. Run ``python -m benchmarks.suite --help``.
Writes a table (stdout and ``results.md``), ``results.json`` and two plots to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import itertools
import json
import math
import random
import statistics
import sys
import threading
import time
import timeit
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad, vmap
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

import remat

from ._models import (
    GPT,
    Block,
    Checkpoint,
    GPTConfig,
    Llama,
    checkpoint_modes,
    make_batches,
    no_checkpoint,
    torch_checkpoint,
)
from ._replay import SAC_OPS, modes_only, thin_replay
from .demo import _bytes, _table

aten = torch.ops.aten


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAC_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def torch_sac(block: Block) -> Block:
    """torch's selective activation checkpointing, saving the matmuls `save_matmuls` saves."""
    context = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
    return functools.partial(checkpoint, block, use_reentrant=False, context_fn=context)


def modes() -> tuple[dict[str, Checkpoint], str | None]:
    """Every mode to compare, and a note when the optional peer is missing."""
    found = checkpoint_modes()
    found = {
        "plain": found.pop("plain"),
        "torch.utils.checkpoint": found.pop("torch.utils.checkpoint"),
        "torch SAC (mm, addmm, bmm, baddbmm)": torch_sac,
        **found,
    }
    if importlib.util.find_spec("torch_remat") is None:
        return found, "torch_remat is not installed (`pip install torch-remat`): left out."
    import torch_remat

    # Its whole-block checkpoint. It refuses `preserve_rng_state`; its documented way
    # to replay the RNG (dropout) is a state hook, as here.
    wrap = torch_remat.checkpoint(recompute_state_hooks=(_RngState(),))
    found["torch_remat"] = wrap
    return found, None


class _RngState:
    """torch_remat's `RecomputeStateHook` for the default CPU and CUDA generators."""

    def snapshot(self) -> Any:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return torch.get_rng_state(), cuda

    def restore(self, state: Any) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])


@dataclasses.dataclass
class Row:
    """One mode on one workload."""

    workload: str
    mode: str
    held: int
    peak: int
    times: list[float] = dataclasses.field(default_factory=list)  # per round
    loss: float | None = None
    same_loss: bool | None = None

    @property
    def time(self) -> float | None:
        """Median seconds per step."""
        return statistics.median(self.times) if self.times else None


def _device_memory(device: torch.device) -> Any:
    """A context with ``.live``/``.peak``: exact storage counts on CPU, allocator on CUDA."""
    if device.type != "cuda":
        return remat.memory.track()

    class Allocator:
        def __enter__(self) -> Allocator:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self

        def __exit__(self, *exc: object) -> None:
            torch.cuda.synchronize()

        @property
        def live(self) -> int:
            return torch.cuda.memory_allocated() - self.base

        @property
        def peak(self) -> int:
            return torch.cuda.max_memory_allocated() - self.base

        def reset_peak(self) -> None:
            torch.cuda.reset_peak_memory_stats()

    return Allocator()


def _measure_memory(step: Callable[[], Tensor], device: torch.device) -> tuple[int, int, Tensor]:
    """Bytes held right after the forward, and the peak over forward and backward."""
    with _device_memory(device) as mem:
        loss = step()
        held = mem.live
        loss.backward()
        peak = mem.peak
    return held, peak, loss.detach()


# What a mode's steps run inside, untimed (`_IdleThread`): a context manager's factory.
Around = Callable[[], contextlib.AbstractContextManager[Any]]


def _interleaved_times(
    steps: dict[str, Callable[[], None]],
    rounds: int,
    warmup: int,
    arounds: dict[str, Around] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step and round, modes taking turns in a shuffled order each round; a step
    runs inside its mode's ``arounds`` entry, if any (entered and exited untimed)."""
    names, order = list(steps), random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in names}
    arounds = arounds or {}
    for i in range(warmup + rounds):
        order.shuffle(names)
        for name in names:
            with arounds.get(name, contextlib.nullcontext)():
                start = time.perf_counter()
                steps[name]()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
    return times


def _time_rows(
    rows: list[Row],
    steps: dict[str, Callable[[], Tensor]],
    rounds: int,
    warmup: int,
    device: torch.device,
    arounds: dict[str, Around] | None = None,
) -> None:
    """Set each row's times: its mode's step, forward and backward, modes interleaved."""
    if not rounds:
        return

    def timed(step: Callable[[], Tensor]) -> None:
        step().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = _interleaved_times(
        {mode: functools.partial(timed, step) for mode, step in steps.items()},
        rounds,
        warmup,
        arounds,
    )
    for row in rows:
        row.times = times[row.mode]


def gpt_workload(
    name: str,
    config: GPTConfig,
    batch: int,
    rounds: int,
    warmup: int,
    device: torch.device,
    model: type[GPT | Llama] = GPT,
    all_modes: dict[str, Checkpoint] | None = None,
) -> list[Row]:
    """A decoder (GPT or Llama): memory and the time of forward plus backward, per mode
    (by default every mode of `modes`)."""
    torch.manual_seed(0)
    base = model(config).to(device)
    tokens, targets = (t.to(device) for t in make_batches(config, batch, 1)[0])
    all_modes = all_modes or modes()[0]
    models = {}
    for mode, wrap in all_modes.items():
        models[mode] = copy.deepcopy(base)
        models[mode].checkpoint = wrap

    def step(model: GPT | Llama) -> Tensor:
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        return model.loss(tokens, targets)

    rows = []
    arounds = {mode: wrap.around for mode, wrap in all_modes.items() if hasattr(wrap, "around")}
    for mode, model in models.items():
        with arounds.get(mode, contextlib.nullcontext)():
            held, peak, loss = _measure_memory(functools.partial(step, model), device)
        rows.append(Row(name, mode, held, peak, loss=loss.item()))
    steps = {mode: functools.partial(step, model) for mode, model in models.items()}
    _time_rows(rows, steps, rounds, warmup, device, arounds)
    plain_loss = rows[0].loss
    for row in rows:
        row.same_loss = row.loss == plain_loss
    return rows


BUDGETS = tuple(i / 20 for i in range(21))
SAC = "torch SAC (mm, addmm, bmm, baddbmm)"


def budget_modes() -> dict[str, Checkpoint]:
    """The budget sweep's modes: `memory_budget` from 0 to 1 in steps of 0.05, and the fixed
    points to compare with (plain, torch's checkpoint and SAC, remat's named policies)."""
    found = modes()[0]
    fixed = ["plain", "torch.utils.checkpoint", SAC]
    fixed += ["remat save_nothing", "remat save_matmuls_no_batch", "remat save_matmuls"]
    sweep = {
        f"memory_budget({f:g})": remat.remat(policy=remat.policies.memory_budget(f))
        for f in BUDGETS
    }
    return {**{mode: found[mode] for mode in fixed}, **sweep}


def dominance_modes(sweep: Sequence[Row]) -> dict[str, Checkpoint]:
    """From the sweep's memory: plain, SAC, `save_matmuls`, and the largest budgets holding at most
    SAC's bytes and at most 0.8x them (the smallest fraction among those holding as much)."""
    sac = next(r for r in sweep if r.mode == SAC)
    budgets = [r for r in sweep if r.mode.startswith("memory_budget")]  # in fraction order
    chosen = {}
    for limit in (1.0, 0.8):
        held = max(r.held for r in budgets if r.held <= limit * sac.held)
        chosen[limit] = next(r.mode for r in budgets if r.held == held)
    found = budget_modes()
    return {mode: found[mode] for mode in ("plain", SAC, "remat save_matmuls", *chosen.values())}


def budget_summary(sweep: Sequence[Row], dominance: Sequence[Row]) -> str:
    """The issue's dominance checks (timed apart, with more rounds) and the sweep's order."""
    by_mode = {r.mode: r for r in dominance}
    sac, matmuls = by_mode[SAC], by_mode["remat save_matmuls"]
    budgets = [r for r in dominance if r.mode.startswith("memory_budget")]
    at_sac, below = max(budgets, key=lambda r: r.held), min(budgets, key=lambda r: r.held)
    lines = [
        f"Timed apart from the sweep, {len(sac.times)} rounds: "
        f"save_matmuls holds {_bytes(matmuls.held)}, step time {_time_ratio(matmuls, sac)} "
        f"SAC's. {at_sac.mode} holds {_bytes(at_sac.held)} ({at_sac.held / sac.held:.2f}x "
        f"SAC's {_bytes(sac.held)}), step time {_time_ratio(at_sac, sac)} SAC's. "
        f"{below.mode} holds {_bytes(below.held)} ({below.held / sac.held:.2f}x SAC's), "
        f"step time {_time_ratio(below, sac)} SAC's."
    ]
    held = [r.held for r in sweep if r.mode.startswith("memory_budget")]
    lines.append(
        "Held bytes over the sweep are "
        + ("non-decreasing" if held == sorted(held) else "NOT non-decreasing")
        + " in the budget."
    )
    return " ".join(lines)


OVERHEAD = GPTConfig(vocab=64, seq=16, width=16, heads=2, blocks=8, dropout=0.1)
# Each remat policy, and the peer whose overhead it is compared with.
UNCHECKED = "remat save_nothing without its generator check"
THREADED = "remat save_nothing, another thread alive"
# References, unsound: what remat's module-state checks cost (`checks`).
UNGUARDED = "remat save_nothing without its module-state checks or generator check"
MATMULS_UNGUARDED = "remat save_matmuls without its module-state checks"
# Reference points, not remat modes (`_replay`): dispatch modes alone, and a thin replay.
MODES_ONLY = "torch.utils.checkpoint under pass-through dispatch modes"
THIN_REPLAY = "torch.utils.checkpoint with a thin verified replay of the matmuls"
OVERHEAD_PEERS = {
    "remat save_nothing": "torch.utils.checkpoint",
    UNCHECKED: "torch.utils.checkpoint",
    THREADED: "torch.utils.checkpoint",
    UNGUARDED: "torch.utils.checkpoint",
    "remat save_matmuls": SAC,
    MATMULS_UNGUARDED: SAC,
    "remat memory_budget(0.5)": SAC,
    MODES_ONLY: SAC,
    THIN_REPLAY: SAC,
}


class _Unwatched:
    """`remat._rng.GeneratorWatch`'s stand-in for `UNCHECKED`: no function mode, so no check
    of generators (nor of batch norm's statistics, which the overhead workload has none of)."""

    def __init__(self, *watch: Any) -> None:
        del watch

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Unguarded:
    """`remat._modules.ModuleState`'s stand-in where the module-state checks are off: no
    capture, so the recompute reads modules as they are then, as torch.utils.checkpoint's does
    (a module switched to ``eval()``, an attribute rebound or a parameter updated before the
    backward then gives a wrong gradient with no error: docs/how-it-works.md#module-state)."""

    @staticmethod
    def capture(*args: Any) -> None:
        del args


def checks(wrap: Checkpoint, generator: bool = True, module_state: bool = True) -> Checkpoint:
    """``wrap``, with the recompute's explicit-generator check and the module-state checks on
    or off (set at each forward, for the backward that follows it): what each costs. Off, a
    draw from a generator the forward did not see gives other numbers, as
    torch.utils.checkpoint's does (docs/rng.md)."""
    watch = remat._rng.GeneratorWatch if generator else _Unwatched
    state = remat._modules.ModuleState if module_state else _Unguarded

    def checkpoint(block: Block) -> Block:
        region = wrap(block)

        def call(*args: Any) -> Any:
            remat._engine.GeneratorWatch = watch  # type: ignore[attr-defined, misc]
            remat._transform.ModuleState = state  # type: ignore[attr-defined, misc]
            return region(*args)

        return call

    return checkpoint


@contextlib.contextmanager
def checks_restored() -> Iterator[None]:
    """Around a run of the modes that turn checks off (`checks`): the checks are back on when
    it ends, so that whatever runs next in the process runs remat as it ships."""
    try:
        yield
    finally:
        remat._engine.GeneratorWatch = remat._rng.GeneratorWatch  # type: ignore[attr-defined]
        remat._transform.ModuleState = remat._modules.ModuleState  # type: ignore[attr-defined]


class _IdleThread:
    """Around a step: another thread alive that draws nothing (a logger's, a data loader's
    pin-memory thread). remat cannot tell that it never draws: the default policy then
    captures random numbers per op, under its dispatch mode (docs/rng.md#threads)."""

    def __enter__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.stop.wait, name="idle", daemon=True)
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def overhead_modes() -> dict[str, Checkpoint]:
    """The overhead workload's modes: the remat policies, their peers and the reference points.
    Each remat mode sets its checks on or off at each call (`checks`), and they stay so until
    the next remat mode sets them: run them inside `checks_restored`."""
    found = modes()[0]
    chosen = {mode: found[mode] for mode in ("plain", "torch.utils.checkpoint", SAC)}
    nothing, matmuls = found["remat save_nothing"], found["remat save_matmuls"]
    chosen["remat save_nothing"] = checks(nothing)
    chosen[UNCHECKED] = checks(nothing, generator=False)
    chosen[THREADED] = checks(nothing)
    chosen[THREADED].around = _IdleThread  # type: ignore[attr-defined]
    chosen[UNGUARDED] = checks(nothing, generator=False, module_state=False)
    chosen["remat save_matmuls"] = checks(matmuls)
    chosen[MATMULS_UNGUARDED] = checks(matmuls, module_state=False)
    chosen["remat memory_budget(0.5)"] = checks(
        remat.remat(policy=remat.policies.memory_budget(0.5))
    )
    chosen[MODES_ONLY], chosen[THIN_REPLAY] = modes_only, thin_replay
    return chosen


def overhead_workload(config: GPTConfig, rounds: int, device: torch.device) -> list[Row]:
    """A transformer so small that compute is negligible (pre-LayerNorm, dropout; width 16,
    8 blocks, batch 2 x 16 by default): a step's time over plain's is each mode's Python
    overhead, as in an eager GPU step whose CPU issue time is the step time."""
    with checks_restored():
        return gpt_workload(
            f"overhead: width {config.width}, {config.blocks} blocks, 2 x {config.seq}",
            config,
            2,
            rounds,
            5,
            device,
            all_modes=overhead_modes(),
        )


def bytecodes(config: GPTConfig, device: torch.device, steps: int = 2) -> dict[str, float]:
    """Python bytecode instructions per step of the overhead workload (forward and backward),
    per mode, counted with `sys.settrace` after three warm-up steps: the Python work, with
    none of the timing noise. (Native code, torch's C++, is not counted.)"""
    torch.manual_seed(0)
    base = GPT(config).to(device)
    tokens, targets = (t.to(device) for t in make_batches(config, 2, 1)[0])
    counts = {}
    with checks_restored():
        for mode, wrap in overhead_modes().items():
            with getattr(wrap, "around", contextlib.nullcontext)():
                counts[mode] = _bytecodes_per_step(base, wrap, tokens, targets, steps)
    return counts


def _bytecodes_per_step(
    base: GPT, wrap: Checkpoint, tokens: Tensor, targets: Tensor, steps: int
) -> float:
    """`bytecodes` for one mode."""
    model = copy.deepcopy(base)
    model.checkpoint = wrap

    def step() -> None:
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        model.loss(tokens, targets).backward()

    for _ in range(3):
        step()
    count = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        count += event == "opcode"
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(previous)
    return count / steps


def bytecode_summary(counts: dict[str, float]) -> str:
    """Each remat policy's bytecodes per step over plain's, relative to its peer's."""
    plain = counts["plain"]
    parts = [
        f"{mode.removeprefix('remat ')} {(counts[mode] - plain) / 1e3:.0f}k = "
        f"{(counts[mode] - plain) / (counts[peer] - plain):.2f}x {peer.split(' (')[0]}'s "
        f"{(counts[peer] - plain) / 1e3:.0f}k"
        for mode, peer in OVERHEAD_PEERS.items()
    ]
    return (
        f"Python bytecodes per step over plain's {plain / 1e3:.0f}k (sys.settrace, "
        "deterministic): " + "; ".join(parts) + "."
    )


def overhead_summary(rows: Sequence[Row]) -> str:
    """Each remat policy's overhead over plain (median step time minus plain's) relative to
    its peer's: torch.utils.checkpoint for save_nothing, SAC for the per-op policies and for
    the two reference points (`_replay`)."""
    by_mode = {r.mode: r for r in rows}
    plain = by_mode["plain"].time
    if plain is None:
        return ""
    overheads = {mode: (row.time or 0.0) - plain for mode, row in by_mode.items()}
    parts = [
        f"{mode.removeprefix('remat ')} {overheads[mode] * 1e3:.2f} ms = "
        f"{overheads[mode] / overheads[peer]:.2f}x {peer.split(' (')[0]}'s "
        f"{overheads[peer] * 1e3:.2f} ms"
        for mode, peer in OVERHEAD_PEERS.items()
    ]
    return (
        f"Overhead over plain's {plain * 1e3:.2f} ms step, medians of "
        f"{len(by_mode['plain'].times)} interleaved rounds: " + "; ".join(parts) + "."
    )


def _random_as_elementwise(call: remat.policies.OpCall) -> float:
    """`memory_budget`'s default cost, a random op priced as any elementwise op (as on CUDA)
    rather than as the CPU's slower draw."""
    cost = remat._budget.estimated_cost(call)
    outputs = call.output if isinstance(call.output, (tuple, list)) else (call.output,)
    device = next((t.device.type for t in outputs if isinstance(t, Tensor)), "cpu")
    slowdown = remat._budget._RANDOM_SLOWDOWN.get(device, 1.0)
    return cost / slowdown if remat._rng.is_random(call.op) else cost


def recompute_flops(config: GPTConfig, batch: int, device: torch.device) -> str:
    """Bytes held after the forward and FLOPs in the backward (which run the recomputes),
    counted by torch's FLOP counter: SAC, and `memory_budget(0.4)` with its default cost and
    with random ops priced as other elementwise ops (issue 26's "at most 0.8x SAC's bytes for
    at most 1.05x its FLOPs")."""
    chosen = {
        SAC: torch_sac,
        "memory_budget(0.4)": remat.remat(policy=remat.policies.memory_budget(0.4)),
        "memory_budget(0.4), random ops as elementwise": remat.remat(
            policy=remat.policies.memory_budget(0.4, cost=_random_as_elementwise)
        ),
    }
    torch.manual_seed(0)
    base = GPT(config).to(device)
    tokens, targets = (t.to(device) for t in make_batches(config, batch, 1)[0])
    counted = {}
    for mode, wrap in chosen.items():
        model = copy.deepcopy(base)
        model.checkpoint = wrap
        for _ in range(3):  # a budget plans on its first call; the third is counted
            torch.manual_seed(1)
            model.zero_grad(set_to_none=True)
            with _device_memory(device) as mem:
                loss = model.loss(tokens, targets)
                held = mem.live
                with FlopCounterMode(display=False) as flops:
                    loss.backward()
        counted[mode] = (held, flops.get_total_flops(), loss.item())
    sac = counted.pop(SAC)
    return (
        f"Recompute FLOPs, reference GPT: SAC's backward runs {sac[1] / 1e9:.2f} GFLOP; "
        + "; ".join(
            f"{mode} holds {held / sac[0]:.2f}x SAC's bytes, its backward {total / 1e9:.2f} "
            f"GFLOP = {total / sac[1]:.3f}x SAC's{'' if loss == sac[2] else ' (OTHER LOSS)'}"
            for mode, (held, total, loss) in counted.items()
        )
        + "."
    )


@torch._inductor.config.patch(compile_threads=1)
def compiled_budget_workload(
    config: GPTConfig,
    batch: int,
    rounds: int,
    warmup: int,
    device: torch.device,
    backend: str,
    budgets: Sequence[float],
) -> list[Row]:
    """Compiled plain GPT under torch's ``activation_memory_budget`` (a global knapsack over
    the partitioner's saved values): the bytes saved for backward and the step time."""
    torch.manual_seed(0)
    base = GPT(config).to(device)
    tokens, targets = (t.to(device) for t in make_batches(config, batch, 1)[0])
    steps, rows = {}, []
    for budget in budgets:
        model = copy.deepcopy(base)
        loss_fn = torch.compile(functools.partial(_own_code(GPT.loss), model), backend=backend)

        def step(model: GPT = model, loss_fn: Callable[..., Tensor] = loss_fn) -> Tensor:
            torch.manual_seed(1)
            model.zero_grad(set_to_none=True)
            return loss_fn(tokens, targets)

        with torch._functorch.config.patch(activation_memory_budget=budget):
            step().backward()  # compiles, under this budget
        saved, loss = _saved_for_backward(step, model)
        mode = f"activation_memory_budget={budget:g}"
        rows.append(Row(f"compiled ({backend}) budget sweep", mode, saved, 0, loss=loss.item()))
        steps[mode] = step
    _time_rows(rows, steps, rounds, warmup, device)
    for row in rows:  # the last budget's loss (1: compiled plain), to the kernels' rounding
        row.same_loss = math.isclose(row.loss, rows[-1].loss, rel_tol=1e-5)
    return rows


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code object,
    and its guards pass for any model of the same structure: compiling ``model.loss`` again
    under another budget would reuse the graph compiled first (compiled plain's)."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _saved_for_backward(step: Callable[[], Tensor], model: torch.nn.Module) -> tuple[int, Tensor]:
    """Bytes of the storages a step's forward saves for backward, and its loss.

    Counted with an outer ``saved_tensors_hooks`` pair, which sees what a compiled
    forward saves too: AOTAutograd saves its residuals through autograd. The model's
    parameters and buffers are not counted: like "held" elsewhere, activations only.
    """
    storages: dict[int, int] = {}
    state = {
        t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())
    }

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in state:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(storages.values()), loss.detach()


def _profiled_peak(step: Callable[[], Tensor]) -> int:
    """Peak bytes allocated over a step's forward and backward, from torch.profiler's
    memory events (which see allocations inside compiled code; `remat.memory.track`
    refuses compiled functions)."""
    from torch.profiler import ProfilerActivity, profile

    # One cycle; acc_events=True only keeps torch 2.11 and 2.12 from warning that it clears
    # events at the end of each cycle.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        step().backward()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


# One compile thread: a pool's idle threads would outlive this workload, and with other
# threads alive remat captures RNG per op (in the test suite's later tests, too).
@torch._inductor.config.patch(compile_threads=1)
def compiled_workload(
    config: GPTConfig, batch: int, rounds: int, warmup: int, device: torch.device, backend: str
) -> list[Row]:
    """The reference GPT under ``torch.compile``, per mode: the bytes the compiled forward
    saves for backward ("held"), the peak over a step, and the step time."""
    torch.manual_seed(0)
    base = GPT(config).to(device)
    tokens, targets = (t.to(device) for t in make_batches(config, batch, 1)[0])
    wraps = {
        "plain": no_checkpoint,
        "torch.utils.checkpoint": torch_checkpoint,
        "torch SAC (mm, addmm, bmm, baddbmm)": torch_sac,
        **{m: w for m, w in checkpoint_modes().items() if m.startswith("remat ")},
    }
    steps, rows = {}, []
    for mode, wrap in wraps.items():
        model = copy.deepcopy(base)
        model.checkpoint = wrap
        loss_fn = torch.compile(model.loss, backend=backend)

        def step(model: GPT = model, loss_fn: Callable[..., Tensor] = loss_fn) -> Tensor:
            torch.manual_seed(1)
            model.zero_grad(set_to_none=True)
            return loss_fn(tokens, targets)

        step().backward()  # compiles
        saved, loss = _saved_for_backward(step, model)
        # track() refuses compiled functions; the profiler sees their allocations
        peak = _measure_memory(step, device)[1] if device.type == "cuda" else _profiled_peak(step)
        rows.append(Row(f"compiled ({backend}) reference GPT", mode, saved, peak, loss=loss.item()))
        steps[mode] = step
    _time_rows(rows, steps, rounds, warmup, device)
    for row in rows:  # compiled plain's loss, to the compiled kernels' rounding
        row.same_loss = math.isclose(row.loss, rows[0].loss, rel_tol=1e-5)
    return rows


def _mlp_weights(depth: int, width: int, hidden: int, device: torch.device) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(depth):
        weights += [torch.randn(width, hidden, generator=gen) / width**0.5]
        weights += [torch.randn(hidden, width, generator=gen) / hidden**0.5]
    return [w.to(device).requires_grad_() for w in weights]


def _mlp_layer(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    return x + F.gelu(x @ w1) @ w2


def mlp_workload(
    depth: int, width: int, hidden: int, batch: int, rounds: int, device: torch.device
) -> list[Row]:
    """An MLP stack of residual layers: memory and time per mode."""
    weights = _mlp_weights(depth, width, hidden, device)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1)).to(device)
    name = f"MLP {depth}x({width}->{hidden}->{width})"
    steps, rows = {}, []
    for mode, wrap in modes()[0].items():
        layer = wrap(_mlp_layer) if mode != "plain" else _mlp_layer

        def step(layer: Block = layer) -> Tensor:
            for w in weights:
                w.grad = None
            h = x
            for w1, w2 in zip(weights[::2], weights[1::2], strict=True):
                h = layer(h, w1, w2)
            return h.square().mean()

        held, peak, loss = _measure_memory(step, device)
        rows.append(Row(name, mode, held, peak, loss=loss.item()))
        steps[mode] = lambda step=step: step().backward()
    if rounds:
        times = _interleaved_times(steps, rounds, 2)
        for row in rows:
            row.times = times[row.mode]
    for row in rows:
        row.same_loss = row.loss == rows[0].loss
    return rows


def depth_sweep(depths: Sequence[int], config: GPTConfig, batch: int, device: torch.device) -> list:
    """Bytes held after the forward against depth, per mode."""
    rows = []
    for depth in depths:
        sized = dataclasses.replace(config, blocks=depth)
        rows += gpt_workload(f"depth {depth}", sized, batch, 0, 0, device)
    return rows


def per_sample_workload(
    depth: int, width: int, hidden: int, batch: int, seq: int, device: torch.device
) -> list[Any]:
    """Per-sample gradients with vmap(grad), each sample a sequence: only remat checkpoints.

    Activations (per sample, ``seq`` tokens) outweigh the per-sample gradients here,
    as in per-example training of a sequence model.
    """
    weights = [w.detach() for w in _mlp_weights(depth, width, hidden, device)]
    xs = torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(2)).to(device)

    def loss(ws: list[Tensor], x: Tensor, layer: Block) -> Tensor:
        h = x
        for w1, w2 in zip(ws[::2], ws[1::2], strict=True):
            h = layer(h, w1, w2)
        return h.square().mean()

    per_sample = vmap(grad(loss), in_dims=(None, 0, None))
    rows, reference = [], None
    for mode, layer in {"plain": _mlp_layer, "remat save_nothing": remat.remat(_mlp_layer)}.items():
        with _device_memory(device) as mem:
            grads = per_sample(weights, xs, layer)
        reference = reference or grads
        same = all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
        workload = f"per-sample grads, vmap(grad), {batch} x {seq} tokens"
        rows.append(Row(workload, mode, 0, mem.peak, same_loss=same))
    try:
        per_sample(weights, xs, functools.partial(checkpoint, _mlp_layer, use_reentrant=False))
    except RuntimeError as error:
        note = f"torch.utils.checkpoint under vmap(grad) fails: {str(error).splitlines()[0]}"
    else:  # pragma: no cover - torch would have to change
        note = "torch.utils.checkpoint ran under vmap(grad)"
    return [*rows, note]


def placement_workload(depth: int, width: int, points: int, device: torch.device) -> list[Row]:
    """Where the region goes under nested reverse mode: a physics-informed loss.

    The loss of Burgers' equation needs ``u``'s first and second derivatives, taken
    with ``create_graph=True`` inside the loss; its backward then differentiates
    through them. Wrapping each layer keeps every layer's double-backward graph;
    wrapping the whole residual function keeps only its input.
    """
    generator = torch.Generator().manual_seed(3)
    sizes = [2] + [width] * depth + [1]
    weights = [
        (torch.randn(m, n, generator=generator) / m**0.5).to(device).requires_grad_()
        for m, n in itertools.pairwise(sizes)
    ]
    points_xt = torch.rand(points, 2, generator=generator).to(device)

    def layer(h: Tensor, w: Tensor) -> Tensor:
        return torch.tanh(h @ w)

    def residual(xt: Tensor, each: Callable[[Block], Block]) -> Tensor:
        xt = xt.detach().requires_grad_()
        h = xt
        for w in weights[:-1]:
            h = each(layer)(h, w)
        u = h @ weights[-1]
        du = torch.autograd.grad(u.sum(), xt, create_graph=True)[0]
        u_x, u_t = du[:, :1], du[:, 1:]
        u_xx = torch.autograd.grad(u_x.sum(), xt, create_graph=True)[0][:, :1]
        return (u_t + u * u_x - 0.01 * u_xx).square().mean()

    def as_is(fn: Block) -> Block:
        return fn

    steps = {
        "plain": functools.partial(residual, points_xt, as_is),
        "remat each layer": functools.partial(residual, points_xt, remat.remat),
        "remat the residual": functools.partial(remat.remat(residual), points_xt, as_is),
    }
    rows, reference = [], None
    for mode, step in steps.items():
        held, peak, loss = _measure_memory(step, device)
        grads = [w.grad for w in weights]
        reference = reference or (loss, grads)
        same = torch.equal(loss, reference[0]) and all(
            torch.equal(a, b) for a, b in zip(grads, reference[1], strict=True)
        )
        for w in weights:
            w.grad = None
        workload = f"placement: Burgers residual (2nd derivatives), {depth} x {width}"
        rows.append(Row(workload, mode, held, peak, same_loss=same))
    return rows


def overhead(repeat: int) -> dict[str, float]:
    """Microseconds per call (forward and backward) of a tiny region."""
    x = torch.randn(8, requires_grad=True)

    def f(x: Tensor) -> Tensor:
        return x.sin().exp()

    cases = {
        "plain": f,
        "torch.utils.checkpoint": functools.partial(checkpoint, f, use_reentrant=False),
        "remat": remat.remat(f),
    }
    best: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, g in cases.items():
            best[name].append(timeit.timeit(lambda g=g: g(x).sum().backward(), number=200) / 200)
    return {name: 1e6 * statistics.median(ts) for name, ts in best.items()}


def rng_overhead(config: GPTConfig, batch: int, repeat: int) -> dict[str, float]:
    """RNG capture: one reference block's forward (with its dropout), ms, with and without.

    With another thread alive, a region captures per random op under a dispatch mode.
    """
    from ._models import DecoderBlock

    block = DecoderBlock(config)
    x = torch.randn(batch, config.seq, config.width, requires_grad=True)
    cases = {
        "plain": block.forward,
        "preserve_rng=True": remat.remat(block.forward),
        "preserve_rng=False": remat.remat(block.forward, preserve_rng=False),
    }
    times: dict[str, list[float]] = {
        name: [] for name in [*cases, *(f"{n}, thread" for n in cases)]
    }
    stop = threading.Event()
    for _ in range(repeat):
        for name, f in cases.items():
            times[name].append(timeit.timeit(lambda f=f: f(x), number=5) / 5)
        idle = threading.Thread(target=stop.wait)
        idle.start()
        for name, f in cases.items():
            times[f"{name}, thread"].append(timeit.timeit(lambda f=f: f(x), number=5) / 5)
        stop.set()
        idle.join()
        stop.clear()
    result = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    for suffix in ("", ", thread"):  # paired within each repeat: the noise both share cancels
        on, off = times[f"preserve_rng=True{suffix}"], times[f"preserve_rng=False{suffix}"]
        costs = [(a - b) / p for a, b, p in zip(on, off, times["plain"], strict=True)]
        result[f"capture %{suffix}"] = 100 * statistics.median(costs)
    return result


def _ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}x" if value and reference else "-"


def _time_ratio(row: Row, reference: Row | None) -> str:
    """Median over rounds of the ratio within each round (the noise both share cancels)."""
    if reference is None or not row.times or not reference.times:
        return "-"
    pairs = zip(row.times, reference.times, strict=True)
    return f"{statistics.median(a / b for a, b in pairs):.3f}x"


def format_rows(rows: Sequence[Row]) -> str:
    """One table per workload: held, peak, time, ratios to plain and to checkpoint."""
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        group = [r for r in rows if r.workload == workload]
        plain = next((r for r in group if r.mode == "plain"), None)
        ckpt = next((r for r in group if r.mode == "torch.utils.checkpoint"), None)
        sac = next((r for r in group if r.mode.startswith("torch SAC")), None)
        body = []
        for r in group:
            body.append(
                [
                    r.mode,
                    _bytes(r.held) if r.held else "-",
                    _ratio(r.held, plain.held if plain else None),
                    _ratio(r.held, ckpt.held if ckpt else None),
                    _bytes(r.peak) if r.peak else "-",
                    _ratio(r.peak, plain.peak if plain else None),
                    f"{1e3 * r.time:.0f} ms" if r.time else "-",
                    _time_ratio(r, plain),
                    _time_ratio(r, ckpt),
                    _time_ratio(r, sac),
                    {True: "yes", False: "NO", None: "-"}[r.same_loss],
                ]
            )
        header = [
            "mode",
            "held",
            "x plain",
            "x ckpt",
            "peak",
            "x plain",
            "time",
            "x plain",
            "x ckpt",
            "x SAC",
            "= plain",
        ]
        out.append(f"### {workload}\n\n{_table(header, body)}")
    return "\n\n".join(out)


def _save(fig: Any, ax: Any, path: Path, **labels: str) -> str:
    """Label a plot, write it as a PNG, and return its file name."""
    ax.set(**labels)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def _plots(rows: Sequence[Row], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    reference = [r for r in rows if r.workload == "reference GPT" and r.time]
    if reference:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r, marker in zip(reference, "osD^vPX*", strict=False):
            ax.scatter(r.time * 1e3, r.held / 2**20, marker=marker, s=60, alpha=0.7, label=r.mode)
        files.append(
            _save(
                fig,
                ax,
                out / "memory_vs_time.png",
                xlabel="step time (ms)",
                ylabel="held after forward (MiB)",
                title="Reference GPT: memory against time",
            )
        )
    budget = [r for r in rows if r.workload.startswith("budget sweep") and r.time]
    if budget:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        curve = [r for r in budget if r.mode.startswith("memory_budget")]
        ax.plot(
            [r.held / 2**20 for r in curve],
            [r.time * 1e3 for r in curve],
            marker=".",
            label="remat memory_budget(0 ... 1, step 0.05)",
        )
        fixed = [r for r in budget if not r.mode.startswith("memory_budget")]
        for r, marker in zip(fixed, "osD^vPX*", strict=False):
            ax.scatter(r.held / 2**20, r.time * 1e3, marker=marker, s=60, alpha=0.7, label=r.mode)
        compiled = [r for r in rows if "budget" in r.workload and r.workload.startswith("compiled")]
        if compiled and all(r.time for r in compiled):
            ax.plot(
                [r.held / 2**20 for r in compiled],
                [r.time * 1e3 for r in compiled],
                marker="x",
                linestyle="--",
                label="torch.compile, activation_memory_budget (saved bytes)",
            )
        files.append(
            _save(
                fig,
                ax,
                out / "budget_sweep.png",
                xlabel="held after forward (MiB)",
                ylabel="step time (ms)",
                title="Reference GPT: memory budget against step time",
            )
        )
    sweep = [r for r in rows if r.workload.startswith("depth ")]
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        styles = zip("osD^vPX*", ["-", "--", "-.", ":"] * 2, strict=False)
        for mode, (marker, line) in zip(dict.fromkeys(r.mode for r in sweep), styles, strict=False):
            points = [(int(r.workload.split()[1]), r.held / 2**20) for r in sweep if r.mode == mode]
            ax.plot(*zip(*points, strict=True), marker=marker, linestyle=line, label=mode)
        title = "Memory against depth"
        ylabel = "held after forward (MiB)"
        files.append(
            _save(fig, ax, out / "memory_vs_depth.png", xlabel="blocks", ylabel=ylabel, title=title)
        )
    plt.close("all")
    return files


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every workload, print the tables, write results.md, results.json and plots."""
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        reference = GPTConfig(vocab=64, seq=16, width=32, heads=2, blocks=2)
        sizes = {"batch": 2, "rounds": 1, "warmup": 0, "depths": (2, 4), "mlp": (4, 16, 32, 4)}
    else:
        reference = GPTConfig(vocab=512, seq=128, width=512, heads=8, blocks=8, dropout=0.1)
        sizes = {
            "batch": 4,
            "rounds": 20,
            "warmup": 2,
            "depths": (4, 8, 16, 32),
            "mlp": (8, 64, 256, 128),
        }
    start = time.perf_counter()
    _, missing = modes()
    header = (
        f"torch {torch.__version__}, {device.type}, {torch.get_num_threads()} threads. "
        f"Memory: {'CUDA allocator' if device.type == 'cuda' else 'remat.memory.track'}."
    )
    print(header + (f"\n{missing}" if missing else ""), flush=True)

    rows = gpt_workload(
        "reference GPT", reference, sizes["batch"], sizes["rounds"], sizes["warmup"], device
    )
    budget_rows = gpt_workload(
        "budget sweep (reference GPT)",
        reference,
        sizes["batch"],
        max(1, sizes["rounds"] // 2),
        sizes["warmup"],
        device,
        all_modes=budget_modes(),
    )
    rows += budget_rows
    dominance = gpt_workload(
        "budget against SAC (reference GPT)",
        reference,
        sizes["batch"],
        sizes["rounds"] * 3 // 2,
        sizes["warmup"],
        device,
        all_modes=dominance_modes(budget_rows),
    )
    rows += dominance
    llama = dataclasses.replace(reference, blocks=4, dropout=0.0)
    rows += gpt_workload(
        "Llama-style, 4 blocks",
        llama,
        sizes["batch"],
        sizes["rounds"],
        sizes["warmup"],
        device,
        model=Llama,
    )
    depth, width, hidden, batch = sizes["mlp"]
    rows += mlp_workload(depth, width, hidden, batch * 8, sizes["rounds"] * 3, device)
    sweep_config = dataclasses.replace(reference, width=max(32, reference.width // 4))
    rows += depth_sweep(sizes["depths"], sweep_config, sizes["batch"], device)
    seq = 16 if args.smoke else 256
    per_sample = per_sample_workload(depth, width // 2, hidden // 2, 16, seq, device)
    note = per_sample.pop()
    rows += per_sample
    rows += placement_workload(2 if args.smoke else 6, width, 64 if args.smoke else 2048, device)
    overhead_rows = overhead_workload(OVERHEAD, 1 if args.smoke else 40, device)
    rows += overhead_rows
    counted = bytecodes(OVERHEAD, device)
    flops = recompute_flops(reference, sizes["batch"], device)

    micro = overhead(3 if args.smoke else 15) if device.type == "cpu" else {}
    rng = (
        rng_overhead(reference, sizes["batch"], 2 if args.smoke else 15)
        if device.type == "cpu"
        else {}
    )
    # inductor compiles each mode in about a minute on 2 cores; the smoke run traces only.
    backend = "aot_eager" if args.smoke else "inductor"
    rows += compiled_workload(
        reference, sizes["batch"], sizes["rounds"] // 2, sizes["warmup"], device, backend
    )
    rows += compiled_budget_workload(
        reference,
        sizes["batch"],
        sizes["rounds"] // 2,
        sizes["warmup"],
        device,
        backend,
        (0.5, 1.0) if args.smoke else (0.25, 0.5, 0.75, 1.0),
    )
    tables = format_rows(rows)
    budget = budget_summary(budget_rows, dominance) if dominance[0].times else ""
    lines = [header, missing or "", tables, budget, overhead_summary(overhead_rows)]
    lines += [bytecode_summary(counted), flops, note]
    if micro:
        lines.append(
            "Tiny region, forward and backward, us per call: "
            + ", ".join(f"{k} {v:.1f}" for k, v in micro.items())
        )
    if rng:
        lines.append(
            "One reference block's forward (dropout 0.1), ms: "
            + ", ".join(f"{k} {v:.3f}" for k, v in rng.items() if "%" not in k)
            + f"; RNG capture costs {rng['capture %']:.2f}% of the block's forward, and "
            f"{rng['capture %, thread']:.2f}% with another thread alive (per-op capture)"
        )
    report = "\n\n".join(line for line in lines if line)
    print(report)
    files = _plots(rows, args.out)
    (args.out / "results.md").write_text(report + "\n")
    results = {
        "header": header,
        "missing": missing,
        "rows": [{**dataclasses.asdict(r), "time": r.time} for r in rows],
        "per_sample_note": note,
        "budget_summary": budget,
        "overhead_summary": overhead_summary(overhead_rows),
        "bytecodes_per_step": counted,
        "bytecode_summary": bytecode_summary(counted),
        "recompute_flops": flops,
        "overhead_us": micro,
        "rng_block_forward_ms": rng,
        "plots": files,
        "seconds": time.perf_counter() - start,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(
        f"\nwrote {args.out}/results.md, results.json, {', '.join(files)} "
        f"({results['seconds']:.0f} s)"
    )
    return results


if __name__ == "__main__":
    main()

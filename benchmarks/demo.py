"""The main demo: memory held and step time of a small GPT, plain vs checkpointed.

Each mode trains its own copy of one model (same initial weights, same batches, same
dropout seeds) with AdamW; modes take turns step by step, in a shuffled order, so that
drift in machine speed affects them all alike. Memory is measured in a separate pass under
`remat.memory.track()`, which counts the bytes of tensor storages that aten ops allocate
and that are still alive, so the numbers are exact and repeat from run to run.

Run ``python benchmarks/demo.py --help`` for the sizes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import statistics
import time
from collections.abc import Sequence

import torch
from torch import Tensor

import remat

if __package__:
    from ._models import GPT, GPTConfig, checkpoint_modes, make_batches
else:  # run as a script: python benchmarks/demo.py
    from _models import GPT, GPTConfig, checkpoint_modes, make_batches

__all__ = ["Result", "format_results", "main", "run"]


@dataclasses.dataclass(frozen=True)
class Result:
    """What one mode measured.

    Attributes:
        mode: the mode's name, as in `checkpoint_modes`.
        held: bytes alive right after the forward returns: what autograd holds for backward.
        peak: the most bytes alive at once during the forward and the backward,
            parameter gradients included.
        step_time: median seconds of a training step (forward, backward, optimizer step).
        loss: the loss on a held-out batch after training, without dropout.
        same_loss: ``loss`` equals plain's bit for bit.
        same_weights: every trained parameter equals plain's bit for bit.
    """

    mode: str
    held: int
    peak: int
    step_time: float
    loss: float
    same_loss: bool
    same_weights: bool


def _train_step(
    model: GPT, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor], seed: int
) -> None:
    torch.manual_seed(seed)  # every mode draws the same dropout masks
    optimizer.zero_grad(set_to_none=True)
    model.loss(*batch).backward()
    optimizer.step()


def _memory(model: GPT, batch: tuple[Tensor, Tensor], seed: int) -> tuple[int, int]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with remat.memory.track() as mem:
        loss = model.loss(*batch)
        held = mem.live
        loss.backward()
    model.zero_grad(set_to_none=True)
    return held, mem.peak


@torch.no_grad()
def _evaluate(model: GPT, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.eval()
    loss = model.loss(*batch)
    model.train()
    return loss


def run(config: GPTConfig, batch: int, steps: int, warmup: int, seed: int = 0) -> list[Result]:
    """Train one copy of the model per mode and measure each; plain comes first."""
    torch.manual_seed(seed)
    base = GPT(config)
    modes = checkpoint_modes()
    models = {}
    for name, checkpoint in modes.items():
        models[name] = copy.deepcopy(base)
        models[name].checkpoint = checkpoint
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    *train, probe, held_out = make_batches(config, batch, steps + 2, seed)

    names = list(modes)
    order = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i, data in enumerate(train):
        order.shuffle(names)  # no mode always runs first, or always after the same one
        for name in names:
            start = time.perf_counter()
            _train_step(models[name], optimizers[name], data, seed + i)
            times[name].append(time.perf_counter() - start)

    losses = {name: _evaluate(model, held_out) for name, model in models.items()}
    plain = models["plain"]
    results = []
    for name, model in models.items():
        held, peak = _memory(model, probe, seed)
        same_weights = all(
            torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True)
        )
        results.append(
            Result(
                mode=name,
                held=held,
                peak=peak,
                step_time=statistics.median(times[name][warmup:]),
                loss=losses[name].item(),
                same_loss=torch.equal(losses[name], losses["plain"]),
                same_weights=same_weights,
            )
        )
    return results


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _seconds(s: float) -> str:
    ms = 1000 * s
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, padded so that it also reads well in a terminal."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |"
        for row in (header, *rows)
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def format_results(results: Sequence[Result], steps: int) -> str:
    """The memory and time table, then the loss table."""
    plain = results[0]
    memory = _table(
        ["mode", "held after forward", "peak", "step time", "x plain"],
        [
            [
                r.mode,
                f"{_bytes(r.held)} ({r.held / plain.held:.2f}x)",
                f"{_bytes(r.peak)} ({r.peak / plain.peak:.2f}x)",
                _seconds(r.step_time),
                f"{r.step_time / plain.step_time:.2f}x",
            ]
            for r in results
        ],
    )
    yes_no = {True: "yes", False: "NO"}
    losses = _table(
        ["mode", f"loss after {steps} steps", "loss == plain", "weights == plain"],
        [[r.mode, repr(r.loss), yes_no[r.same_loss], yes_no[r.same_weights]] for r in results],
    )
    return f"{memory}\n\n{losses}"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = GPTConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=defaults.blocks)
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--seq", type=int, default=defaults.seq)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="training steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    return args


def main(argv: Sequence[str] | None = None) -> list[Result]:
    """Parse the flags, run every mode, print the tables, and return the results."""
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = GPTConfig(
        vocab=args.vocab,
        seq=args.seq,
        width=args.width,
        heads=args.heads,
        blocks=args.blocks,
        dropout=args.dropout,
    )
    params = sum(p.numel() for p in GPT(config).parameters())
    print(
        f"GPT: {config.blocks} blocks, width {config.width}, {config.heads} heads, "
        f"vocab {config.vocab}, dropout {config.dropout}, {params / 1e6:.2f}M parameters; "
        f"batch {args.batch} x seq {config.seq}, fp32"
    )
    print(
        f"torch {torch.__version__} on CPU, threads: {torch.get_num_threads()}; "
        f"{args.steps} AdamW steps per mode, modes interleaved; step time is the median "
        f"of the last {args.steps - args.warmup}\n",
        flush=True,
    )
    start = time.perf_counter()
    results = run(config, args.batch, args.steps, args.warmup, args.seed)
    print(format_results(results, args.steps))
    print(f"\n({time.perf_counter() - start:.1f} s)")
    return results


if __name__ == "__main__":
    main()

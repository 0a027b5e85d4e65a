"""Step times where the GPU is fast and Python issues the kernels: the reference GPT (fp32)
and a random-init Hugging Face Llama (bf16), remat's policies against torch's checkpoint,
SAC and Hugging Face's own checkpointing. Modes interleaved, medians; one process.

``make gpu-check`` runs it after the bench; ``python -m benchmarks.gpu_steps --help``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import remat

from . import suite
from ._models import GPT, GPTConfig, make_batches

HF = "Hugging Face checkpointing"
HF_SAC = "Hugging Face checkpointing + SAC (mm, addmm, bmm, baddbmm)"
# (mode, peer): the ratios the report gives, each mode's step over its peer's.
GPT_RATIOS = (
    ("remat save_nothing", "torch.utils.checkpoint"),
    (suite.UNCHECKED, "torch.utils.checkpoint"),
    (suite.UNGUARDED, "torch.utils.checkpoint"),
    ("remat save_matmuls", suite.SAC),
    ("remat memory_budget(0.5)", suite.SAC),
)
LLAMA_RATIOS = (
    ("remat save_nothing", HF),
    ("remat save_matmuls", HF_SAC),
    ("remat save_matmuls", HF),
    ("remat memory_budget(0.5)", HF_SAC),
)


@dataclasses.dataclass
class Sizes:
    gpt: GPTConfig
    llama: dict[str, int]
    batch: int
    seq: int
    rounds: int
    warmup: int


def sizes(smoke: bool) -> Sizes:
    if smoke:
        gpt = GPTConfig(vocab=64, seq=16, width=32, heads=2, blocks=2, dropout=0.1)
        llama = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2)
        return Sizes(gpt, {**llama, "num_attention_heads": 4, "vocab_size": 128}, 2, 16, 1, 0)
    gpt = GPTConfig(vocab=512, seq=128, width=512, heads=8, blocks=8, dropout=0.1)
    llama = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8)
    return Sizes(gpt, {**llama, "num_attention_heads": 16, "vocab_size": 32000}, 4, 1024, 30, 3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gpt_rows(size: Sizes, device: torch.device) -> list[suite.Row]:
    """The bench's reference GPT in every mode of the bench, `memory_budget(0.5)`, and
    `save_nothing` without its generator check and without its module-state checks too (what
    each costs, as on the overhead workload). Every remat mode sets its checks (`suite.checks`)."""
    overhead = suite.overhead_modes()
    all_modes = {
        mode: suite.checks(wrap) if mode.startswith("remat") else wrap
        for mode, wrap in suite.modes()[0].items()
    }
    for mode in (
        "remat save_nothing",
        "remat memory_budget(0.5)",
        suite.UNCHECKED,
        suite.UNGUARDED,
    ):
        all_modes[mode] = overhead[mode]
    with suite.checks_restored():
        return suite.gpt_workload(
            "reference GPT", size.gpt, 4, size.rounds, size.warmup, device, all_modes=all_modes
        )


# The modes whose kernels and GPU time `gpu_busy` counts, on the reference GPT.
BUSY_MODES = (
    "plain",
    "torch.utils.checkpoint",
    suite.SAC,
    "remat save_nothing",
    "remat save_matmuls",
)


def gpu_busy(size: Sizes, device: torch.device, rows: Sequence[suite.Row], steps: int = 3) -> str:
    """Per mode of `BUSY_MODES` on the reference GPT: the CUDA kernels a step runs and the time
    the GPU is busy with them (torch.profiler, over ``steps`` steps after as many unprofiled),
    beside the step's median time from ``rows``. Where the GPU is busy for a small part of
    the step, the step is the CPU issuing kernels: Python's overhead is the step's time."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = GPT(size.gpt).to(device)
    tokens, targets = (t.to(device) for t in make_batches(size.gpt, 4, 1)[0])
    every = suite.modes()[0]
    median = {row.mode: row.time for row in rows}
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    lines = [
        f"Reference GPT, kernels and GPU time per step (torch.profiler, {steps} steps):\n",
        "| mode | kernels per step | GPU busy per step | step |",
        "|---|---|---|---|",
    ]
    for mode in BUSY_MODES:
        model.checkpoint = every[mode]

        def step() -> None:
            torch.manual_seed(1)
            model.zero_grad(set_to_none=True)
            model.loss(tokens, targets).backward()
            _sync(device)

        for _ in range(steps):
            step()
        with profile(activities=activities, acc_events=True) as prof:
            for _ in range(steps):
                step()
        kernels = [
            e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        count = sum(e.count for e in kernels) / steps
        busy = sum(e.self_device_time_total for e in kernels) / steps / 1e3  # us to ms
        wall = median.get(mode)
        lines.append(
            f"| {mode} | {count:.0f} | {busy:.2f} ms | "
            + (f"{wall * 1e3:.1f} ms |" if wall is not None else "- |")
        )
    return "\n".join(lines)


def _hf_checkpointing(model: Any, kwargs: dict[str, Any] | None = None) -> Any:
    # transformers 5.23 names it activation_checkpointing_enable; 5.17 has only the old name.
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)(kwargs)
    return model


def llama_modes() -> dict[str, Callable[[nn.Module], nn.Module]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    sac = functools.partial(create_selective_checkpoint_contexts, suite._sac_policy)
    budget = remat.policies.memory_budget(0.5)
    return {
        "plain": lambda m: m,
        HF: _hf_checkpointing,
        HF_SAC: lambda m: _hf_checkpointing(m, {"use_reentrant": False, "context_fn": sac}),
        "remat save_nothing": lambda m: remat.apply(m, LlamaDecoderLayer),
        "remat save_matmuls": lambda m: remat.apply(m, LlamaDecoderLayer, policy="save_matmuls"),
        "remat memory_budget(0.5)": lambda m: remat.apply(m, LlamaDecoderLayer, policy=budget),
    }


def llama_rows(size: Sizes, device: torch.device) -> list[suite.Row]:
    """A random-init Llama (bf16 on a GPU, fp32 on CPU), each mode a deep copy of one model:
    peak bytes over one step, and the step's time over interleaved rounds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=size.seq, attn_implementation="sdpa", **size.llama)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = LlamaForCausalLM(config).to(device, dtype).train()
    tokens = torch.randint(config.vocab_size, (size.batch, size.seq), generator=torch.Generator())
    tokens = tokens.to(device)
    models = {name: make(copy.deepcopy(base)) for name, make in llama_modes().items()}

    def forward(model: nn.Module) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return model(input_ids=tokens, labels=tokens).loss

    def step(model: nn.Module) -> None:
        forward(model).backward()
        _sync(device)

    rows = []
    for name, model in models.items():
        held, peak, loss = suite._measure_memory(functools.partial(forward, model), device)
        rows.append(suite.Row("HF Llama", name, held, peak, loss=loss.item()))
    steps = {name: functools.partial(step, model) for name, model in models.items()}
    times = suite._interleaved_times(steps, size.rounds, size.warmup)
    for row in rows:
        row.times = times[row.mode]
        row.same_loss = row.loss == rows[0].loss
    return rows


def ratios(rows: Sequence[suite.Row], pairs: Sequence[tuple[str, str]]) -> list[str]:
    """``mode / peer: 1.234x (paired 1.230x, 1.100x to 1.350x)``, for each pair whose both rows
    were timed: the ratio of the medians, then the ratios within each round: their median,
    and their 10th and 90th percentiles (a GPU machine's host is noisy: the spread shows it)."""
    timed = {row.mode: row for row in rows if row.times}
    median = {mode: statistics.median(row.times) for mode, row in timed.items()}
    lines = []
    for mode, peer in pairs:
        if mode not in timed or peer not in timed:
            continue
        paired = [a / b for a, b in zip(timed[mode].times, timed[peer].times, strict=True)]
        low, high = _percentiles(paired)
        lines.append(
            f"{mode} / {peer}: {median[mode] / median[peer]:.3f}x (paired "
            f"{statistics.median(paired):.3f}x, {low:.3f}x to {high:.3f}x)"
        )
    return lines


def _percentiles(values: Sequence[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles, within the values (the value itself, for one)."""
    if len(values) < 2:
        return min(values), max(values)
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device, size = torch.device(args.device), sizes(args.smoke)
    start = time.perf_counter()
    random.seed(0)
    gpt, llama = gpt_rows(size, device), llama_rows(size, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"torch {torch.__version__}, {name}; {size.rounds} interleaved rounds, medians."]
    lines += [suite.format_rows(gpt), *ratios(gpt, GPT_RATIOS), gpu_busy(size, device, gpt)]
    lines += [suite.format_rows(llama), *ratios(llama, LLAMA_RATIOS)]
    lines.append(f"({time.perf_counter() - start:.0f} s)")
    report = "\n\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()

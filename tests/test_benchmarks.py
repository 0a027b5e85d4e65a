"""The benchmark suite runs end to end at tiny sizes, so it cannot rot."""

import json
import re

import pytest
import torch

import remat
from tests.helpers import import_benchmark

suite = import_benchmark("suite")


def test_suite_smoke_run_writes_table_json_and_plots(tmp_path, capsys):
    """A --smoke run measures every mode on every workload and writes all its outputs."""
    results = suite.main(["--smoke", "--out", str(tmp_path), "--threads", "1"])
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["rows"] == results["rows"]
    assert sorted(written["plots"]) == [
        "budget_sweep.png",
        "memory_vs_depth.png",
        "memory_vs_time.png",
    ]
    for plot in written["plots"]:
        assert (tmp_path / plot).stat().st_size > 0
    modes = set(suite.modes()[0])
    workloads = {row["workload"] for row in written["rows"]}
    # Per-sample and placement workloads compare their own modes; compiled, all but torch_remat.
    placement = {"plain", "remat each layer", "remat the residual"}
    for workload in {w for w in workloads if not w.startswith("per-sample")}:
        expected = placement if workload.startswith("placement:") else modes
        if workload.startswith("compiled"):
            expected = modes - {"torch_remat"}
        if "budget sweep" in workload:
            expected = set(suite.budget_modes())
            if workload.startswith("compiled"):
                expected = {"activation_memory_budget=0.5", "activation_memory_budget=1"}
        found = {r["mode"] for r in written["rows"] if r["workload"] == workload}
        if workload.startswith("overhead:"):
            expected = {"plain", "torch.utils.checkpoint", suite.SAC, *suite.OVERHEAD_PEERS}
        if workload.startswith("budget against SAC"):  # budgets chosen by the sweep's bytes
            expected = {"plain", suite.SAC, "remat save_matmuls"}
            found = {m for m in found if not m.startswith("memory_budget")}
        assert found == expected
    assert any(w.startswith("placement:") for w in workloads)
    assert any(w.startswith("compiled (aot_eager)") for w in workloads)
    assert all(r["same_loss"] for r in written["rows"]), "every mode computes plain's loss"
    reference = [r for r in written["rows"] if r["workload"] == "reference GPT"]
    assert all(r["time"] > 0 for r in reference)
    table = (tmp_path / "results.md").read_text()
    assert "### reference GPT" in table
    assert table.strip() in capsys.readouterr().out
    assert "fails" in written["per_sample_note"]
    assert "non-decreasing in the budget" in written["budget_summary"]
    assert "save_matmuls" in written["overhead_summary"]
    assert "without its generator check" in written["overhead_summary"]
    assert set(written["bytecodes_per_step"]) == set(suite.overhead_modes())
    assert "save_matmuls" in written["bytecode_summary"]
    assert "random ops as elementwise holds" in written["recompute_flops"]
    assert "OTHER LOSS" not in written["recompute_flops"]
    assert any(w.startswith("overhead:") for w in workloads)
    # torch's budget compiles its own graph (not compiled plain's, cached by Dynamo).
    compiled = {r["mode"]: r["held"] for r in written["rows"] if "compiled" in r["workload"]}
    assert compiled["activation_memory_budget=0.5"] < compiled["activation_memory_budget=1"]


def test_bytecode_counts_repeat_and_grow_with_the_work_done():
    """The bench's bytecode count is steady from run to run (within 1%: a collector pass or
    a weak reference's callback may fall in one run's steps and not the other's), and counts
    more for modes that do more: checkpoint's hooks, then SAC's dispatch modes."""
    config = suite.dataclasses.replace(suite.OVERHEAD, blocks=2)
    first, second = (suite.bytecodes(config, torch.device("cpu"), steps=1) for _ in range(2))
    for mode, count in first.items():
        assert abs(second[mode] - count) <= 0.01 * count, mode
    assert first["plain"] < first["torch.utils.checkpoint"] < first[suite.SAC]


def _checks_on() -> bool:
    return (
        remat._engine.GeneratorWatch is remat._rng.GeneratorWatch
        and remat._transform.ModuleState is remat._modules.ModuleState
    )


def test_the_modes_without_checks_leave_them_on_for_what_runs_after():
    """`UNCHECKED` (save_nothing without its generator check) runs fewer bytecodes than
    save_nothing, the check's, and `UNGUARDED` (without its module-state checks too) fewer
    still; `MATMULS_UNGUARDED` fewer than save_matmuls. Once the workloads that time them end,
    remat runs with its checks again (the bench's tiny-region timing ran without the generator
    check, after the bytecode count)."""
    config = suite.dataclasses.replace(suite.OVERHEAD, blocks=1)
    counts = suite.bytecodes(config, torch.device("cpu"), steps=1)
    assert counts[suite.UNGUARDED] < counts[suite.UNCHECKED] < counts["remat save_nothing"]
    assert counts[suite.MATMULS_UNGUARDED] < counts["remat save_matmuls"]
    assert _checks_on()
    suite.overhead_workload(config, 1, torch.device("cpu"))
    assert _checks_on()


def test_a_mode_sets_its_checks_at_each_call_whatever_ran_before():
    """Each remat mode of the overhead workload runs with its own checks, also right after a
    mode that turned them off: save_nothing's region captures module state, `UNGUARDED`'s
    does not, whichever ran last."""
    regions: list[bool] = []
    capture = remat._modules.ModuleState.capture

    def spy(*args):  # (the real capture, noting whether a region captured)
        state = capture(*args)
        regions.append(state is not None)
        return state

    modes = suite.overhead_modes()
    block = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    with suite.checks_restored(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(remat._modules.ModuleState, "capture", spy)
        for mode in ("remat save_nothing", suite.UNGUARDED, "remat save_matmuls"):
            modes[mode](block)(x).sum().backward()
            regions.append(None)
    assert regions == [True, None, None, True, None]
    assert _checks_on()


def test_the_threaded_mode_times_its_steps_with_another_thread_alive():
    """`THREADED` runs each step (timed, and counted in bytecodes) with another thread alive,
    so remat's default policy takes its threaded mode there, and only there; the thread ends
    with the step."""
    around = suite.overhead_modes()[suite.THREADED].around
    seen: dict[str, list[bool]] = {"threaded": [], "plain": []}
    steps = {mode: lambda mode=mode: seen[mode].append(remat._rng.threaded()) for mode in seen}
    suite._interleaved_times(steps, 2, 1, {"threaded": around})
    assert seen == {"threaded": [True] * 3, "plain": [False] * 3}
    config = suite.dataclasses.replace(suite.OVERHEAD, blocks=1)
    counts = suite.bytecodes(config, torch.device("cpu"), steps=1)
    assert counts[suite.THREADED] > 1.2 * counts["remat save_nothing"]  # (per-op capture)
    assert not remat._rng.threaded()


def test_the_thin_replay_reference_keeps_the_matmuls_and_checks_each_op():
    """The overhead workload's thin verified replay computes plain's gradient, and raises at
    the first op its recompute runs differently (it is a check, not only a cost)."""
    replay = import_benchmark("_replay")
    scale = [2.0]
    w = torch.randn(4, 4, requires_grad=True)

    def block(x):
        return torch.tanh((x @ w).sin() * scale[0]) @ w

    x = torch.randn(3, 4, requires_grad=True)
    (expected,) = torch.autograd.grad(block(x).square().sum(), w)
    (got,) = torch.autograd.grad(replay.thin_replay(block)(x).square().sum(), w)
    assert torch.equal(got, expected)

    out = replay.thin_replay(block)(x)
    scale[0] = 3.0  # the recompute's multiplication reads another constant: not the forward's
    with pytest.raises(RuntimeError, match="is not the forward's"):
        out.sum().backward()


def test_gpu_steps_smoke_run_times_every_mode_with_plain_s_loss():
    """``benchmarks.gpu_steps`` (which make gpu-check runs) at tiny sizes: the reference GPT
    and the Hugging Face Llama in every mode, each loss plain's, and each ratio reported."""
    gpu_steps = import_benchmark("gpu_steps")
    size = gpu_steps.sizes(smoke=True)
    device = torch.device("cpu")
    gpt, llama = gpu_steps.gpt_rows(size, device), gpu_steps.llama_rows(size, device)
    assert {row.mode for row in llama} == set(gpu_steps.llama_modes())
    assert all(row.same_loss and row.times for row in [*gpt, *llama])
    lines = gpu_steps.ratios(gpt, gpu_steps.GPT_RATIOS) + gpu_steps.ratios(
        llama, gpu_steps.LLAMA_RATIOS
    )
    assert len(lines) == len(gpu_steps.GPT_RATIOS) + len(gpu_steps.LLAMA_RATIOS)
    number = r"(\d+\.\d{3})x"  # one noisy round of a tiny model may pass 10x
    for line in lines:
        found = re.search(rf"{number} \(paired {number}, {number} to {number}\)$", line)
        assert found, line
        _, paired, low, high = map(float, found.groups())
        assert low <= paired <= high, line
    assert _checks_on()  # after `UNCHECKED` and `UNGUARDED`
    # On the CPU no kernel runs: the table's rows are there, with the steps' times.
    modes = gpu_steps.BUSY_MODES
    table = gpu_steps.gpu_busy(size, device, gpt, steps=1).splitlines()[-len(modes) :]
    assert [line.split(" | ")[0] for line in table] == [f"| {mode}" for mode in modes]
    assert all(" | 0 | 0.00 ms | " in line and line.endswith(" ms |") for line in table)

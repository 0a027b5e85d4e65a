"""Regions under `torch.compile`: traced into one graph, policies honoured by the partitioner."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import remat
from remat import policies
from remat._rng import threaded
from tests.helpers import assert_tree_equal

aten = torch.ops.aten
DTYPE = torch.float64
WIDTH = 16
SHAPE = (2, 8, WIDTH)  # batch, sequence, width


class Block(nn.Module):
    """A pre-norm transformer block: one attention head, an MLP, dropout on both."""

    def __init__(self, dtype: torch.dtype, attention: bool) -> None:
        super().__init__()
        self.attention = attention
        if attention:
            self.norm1 = nn.LayerNorm(WIDTH, dtype=dtype)
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH, dtype=dtype)
            self.proj = nn.Linear(WIDTH, WIDTH, dtype=dtype)
        self.norm2 = nn.LayerNorm(WIDTH, dtype=dtype)
        self.up = nn.Linear(WIDTH, 4 * WIDTH, dtype=dtype)
        self.down = nn.Linear(4 * WIDTH, WIDTH, dtype=dtype)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention:
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            scores = torch.softmax(q @ k.transpose(-2, -1) / WIDTH**0.5, dim=-1)
            x = x + self.drop(self.proj(scores @ v))
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm2(x)))))


class Stack(nn.Module):
    def __init__(self, wrap, dtype: torch.dtype, attention: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dtype, attention) for _ in range(3))
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


def _model(wrap, dtype=DTYPE, attention=True):
    torch.manual_seed(0)
    return Stack(wrap, dtype, attention)


def _input(seed=0, dtype=DTYPE):
    return torch.randn(*SHAPE, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _steps(model, steps=3, backend="aot_eager", dtype=DTYPE):
    """Loss and gradients of ``steps`` compiled steps (fullgraph, no recompile after the first)."""
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    history = []
    for step in range(steps):
        x = _input(step, dtype)
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
    x = _input()
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


def _regions(how: str, policy: str) -> Stack:
    """The test model, its blocks made regions by `remat.remat` at each call, by
    `remat.apply`, or by `remat.checkpoint`."""
    if how == "apply":
        return remat.apply(_model(_plain), Block, policy=policy)
    if how == "checkpoint":
        return _model(lambda block: functools.partial(remat.checkpoint, block, policy=policy))
    if how == "checkpoint_partial":  # as Hugging Face's layers call it, with a new partial
        return _model(
            lambda block: (
                lambda *args: remat.checkpoint(functools.partial(block), *args, policy=policy)
            )
        )
    return _model(remat.remat(policy=policy))


HOW = ["remat", "apply", "checkpoint", "checkpoint_partial"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_explain_reports_one_graph_and_no_break(policy, how):
    explanation = torch._dynamo.explain(_regions(how, policy))(_input())
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_memory_budget_refuses_to_compile(fullgraph):
    """`memory_budget` chooses from an eager forward: under torch.compile it raises, naming
    itself and what to use instead. Without ``fullgraph`` too, where Dynamo runs the
    region's frame as is after the raise: it raised a misleading `RecomputeError` at the
    backward instead."""
    model = _model(remat.remat(policy=policies.memory_budget(0.5)))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    with pytest.raises(RuntimeError, match=r"memory_budget\(0.5\) chooses what to keep from a"):
        compiled(_input()).backward()


def test_memory_budget_region_run_eagerly_inside_a_compiled_model():
    """The way out the refusal names: the region under ``torch.compiler.disable`` runs
    eagerly inside the compiled model, with eager plain's loss and gradients."""
    budget = remat.remat(policy=policies.memory_budget(0.5))
    results = []
    for wrap in (_plain, budget):
        model = _model(lambda block, wrap=wrap: torch.compiler.disable(wrap(block)))
        torch.manual_seed(100)
        loss = torch.compile(model, backend="aot_eager")(_input())
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    assert_tree_equal(*results)


def test_inductor_float32_matches_compiled_plain():
    """inductor in float32, dropout on: loss and gradients within 1e-5 of compiled plain's."""
    steps = functools.partial(_steps, steps=2, backend="inductor", dtype=torch.float32)
    # One compile thread: a pool's idle threads would outlive the test, and with other
    # threads alive remat captures RNG per op (tests of its lending would see that).
    with torch._inductor.config.patch(compile_threads=1):
        expected = steps(_model(_plain, torch.float32))
        for policy in ("save_nothing", "save_matmuls"):
            got = steps(_model(remat.remat(policy=policy), torch.float32))
            for (loss, grads), (plain_loss, plain_grads) in zip(got, expected, strict=True):
                torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(grads, plain_grads, rtol=1e-5, atol=1e-5)
    assert not threaded()  # no compile pool left (tqdm's monitor thread does not count)


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_compiled_func_grad_over_regions_equals_eager(policy):
    """Under a torch.func transform the region is traced as it is: Dynamo's graph of the
    transform computes the gradients itself (torch's checkpoint operator cannot run there)."""
    model = _model(remat.remat(policy=policy)).eval()
    params = dict(model.named_parameters())

    def loss(params, x):
        return torch.func.functional_call(model, params, (x,))

    grad = torch.func.grad(loss)
    expected = grad(params, _input())
    got = torch.compile(grad, backend="aot_eager", fullgraph=True)(params, _input())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


_COMPILED = torch.compile(torch.sin, backend="aot_eager")


class _HoldsCompiled(nn.Module):
    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        if in_place:
            self.inner.compile(backend="aot_eager")
        else:
            self.inner = torch.compile(self.inner, backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).tanh()


def _names_compiled(x: torch.Tensor) -> torch.Tensor:
    return _COMPILED(x).cos()


def _applied_to_compiled(x: torch.Tensor) -> torch.Tensor:
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    block[0] = torch.compile(block[0], backend="aot_eager")
    return remat.apply(block, lambda name, _: name == "0")(x)


class _CompiledMethod(nn.Module):
    @torch.compile(backend="aot_eager")
    def act(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x).cos()


class _HoldsCode(nn.Module):
    """Compiled code in one of its attributes (`held`): a function, in a list, a dict or a
    partial, a module in a plain list, a bound method of another module, or its own
    ``forward`` rebound to a compiled one, or a submodule whose class compiles a method."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.inner = nn.Linear(4, 4)
        if held == "attribute":
            self.act = _COMPILED
        elif held == "list":
            self.acts = [torch.tanh, _COMPILED]
        elif held == "dict":
            self.acts = {"act": _COMPILED}
        elif held == "partial":
            self.act = functools.partial(_COMPILED)
        elif held == "module in a list":
            self.blocks = [torch.compile(nn.Tanh(), backend="aot_eager")]
        elif held == "bound method":
            self.act = _CompiledMethod().act
        elif held == "method of a submodule":
            self.sub = _CompiledMethod()
        elif held == "forward rebound":
            self.inner.forward = torch.compile(self.inner.forward, backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        if self.held in ("attribute", "partial", "bound method"):
            h = self.act(h)
        elif self.held in ("list", "dict"):
            h = self.acts[1 if self.held == "list" else "act"](h)
        elif self.held == "module in a list":
            h = self.blocks[0](h)
        elif self.held == "method of a submodule":
            h = self.sub(h)
        return h.tanh()


_REGIONS_WITH_COMPILED_CODE = {
    "fn": lambda x: remat.remat(torch.compile(torch.cos, backend="aot_eager")),
    "apply": _applied_to_compiled,
    "child": lambda x: remat.apply(_HoldsCompiled())(x),
    "child compiled in place": lambda x: remat.apply(_HoldsCompiled(in_place=True))(x),
    "global": lambda x: remat.remat(_names_compiled)(x),
    "closure": lambda x: remat.remat(lambda y: _COMPILED(y) * 2)(x),
    "method": lambda x: remat.apply(_CompiledMethod())(x),
    **{
        f"held: {held}": functools.partial(lambda held, x: remat.apply(_HoldsCode(held))(x), held)
        for held in (
            "attribute",
            "list",
            "dict",
            "partial",
            "module in a list",
            "bound method",
            "method of a submodule",
            "forward rebound",
        )
    },
}


@pytest.mark.parametrize("where", _REGIONS_WITH_COMPILED_CODE)
def test_compiled_code_inside_a_region_raises(where):
    """The other nesting, remat(torch.compile(block)), and compiled code a region reaches
    (a submodule, a function its code names or closes over, a method its class compiles,
    one a module holds in an attribute): a TypeError naming it, at remat(...) or the
    first call. It gave other gradients than the compiled block's with no error
    (inductor; the "held" cases until stop 55), or a RecomputeError on later steps:
    torch runs compiled code eagerly under remat's dispatch mode and compiles it again
    under its function modes."""
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError, match=r"(?s)compiled .*torch.compile\(remat\(fn\)\)"):
        _REGIONS_WITH_COMPILED_CODE[where](x)


class _Helper:
    @torch.compile
    def act(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x) * x.sigmoid()


# (Dynamo reads `.grad` of a non-leaf while it traces under remat's modes: torch 2.15 warns.)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_code_a_plain_object_holds_runs():
    """Compiled code reached through a plain object's attributes is not refused: it
    runs, unchecked, with gradients within float32 rounding of plain's (inductor's
    kernels may differ from the recompute's in the last bits)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    block.helper = _Helper()  # type: ignore[assignment]

    def run(f):
        block.zero_grad(set_to_none=True)
        out = f(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
        out.square().sum().backward()
        return out.detach(), [p.grad for p in block.parameters()]

    def forward(x: torch.Tensor) -> torch.Tensor:
        return block(block.helper.act(block(x)))

    with torch._inductor.config.patch(compile_threads=1):  # no compile pool left alive
        expected = run(forward)
        torch.testing.assert_close(run(remat.remat(forward)), expected, rtol=1e-5, atol=1e-6)


def test_disabled_code_inside_a_region_runs_as_plain():
    """What torch.compiler.disable wraps runs eagerly, and so is not refused."""
    torch.manual_seed(0)
    block = nn.Sequential(torch.compiler.disable(nn.Linear(4, 4)), nn.Dropout(0.5))
    disabled = torch.compiler.disable(torch.sin)

    def run(f):
        block.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        out = f(torch.ones(2, 4))
        out.square().sum().backward()
        return out.detach(), [p.grad for p in block.parameters()]

    assert_tree_equal(
        run(remat.remat(lambda x: disabled(block(x)))), run(lambda x: disabled(block(x)))
    )


def test_memory_track_refuses_a_compiled_function():
    """Dynamo would run the function eagerly under `track`'s dispatch mode: refuse."""
    compiled = torch.compile(_model(remat.remat), backend="aot_eager")
    refused = pytest.raises(RuntimeError, match=r"cannot measure a torch\.compile")
    with remat.memory.track(), refused:
        compiled(_input())


@pytest.mark.parametrize("how", HOW)
def test_compiled_regions_save_what_compiled_checkpoint_and_sac_save(how):
    """save_nothing saves what compiled torch.utils.checkpoint saves, save_matmuls what
    compiled SAC saves, and both strictly less than compiled plain (fullgraph)."""
    plain = _saved_bytes(_model(_plain))
    nothing = _saved_bytes(_regions(how, "save_nothing"))
    matmuls = _saved_bytes(_regions(how, "save_matmuls"))
    assert nothing <= _saved_bytes(_model(_torch_checkpoint))
    assert matmuls <= _saved_bytes(_model(_sac))
    assert nothing < matmuls < plain


class _Broken(nn.Module):
    """A block Dynamo traces in two pieces, so torch's checkpoint runs it eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH, dtype=DTYPE)
        self.down = nn.Linear(WIDTH, WIDTH, dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        torch._dynamo.graph_break()
        return self.down(h).sin()


def test_saved_tensors_hooks_see_what_a_broken_regions_policy_keeps():
    """A region with a graph break runs torch's selective checkpoint eagerly. remat passes
    `respect_saved_tensors_hooks=True` where torch has it (2.14 on; unset, torch warns, which
    fails this test): the hooks around the call see the matmul outputs the policy keeps.
    Older torch's selective checkpoint has no such option and bypasses them."""
    torch.manual_seed(0)
    block = _Broken()
    x = torch.randn(8, WIDTH, dtype=DTYPE, requires_grad=True)  # 2-d: linear is addmm
    packed: list[torch.Tensor] = []
    compiled = torch.compile(remat.remat(block, policy="save_matmuls"), backend="aot_eager")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = compiled(x)
    out.sum().backward()
    up = block.up(x)
    kept = [any(torch.equal(t, m) for t in packed) for m in (up, block.down(torch.tanh(up)))]
    respects = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    assert kept == [respects, respects]


def test_in_place_op_on_a_kept_value_in_a_broken_region_raises():
    """As docs/limitations.md says: in a region with a graph break, torch's selective
    checkpoint refuses an in-place op on a value the policy keeps; eager remat runs it."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        h.mul_(2)
        torch._dynamo.graph_break()
        return (h.sin() @ w).sum()

    x = torch.linspace(-1, 1, 16, dtype=DTYPE).view(4, 4)
    w = torch.linspace(0, 1, 16, dtype=DTYPE).view(4, 4).requires_grad_()
    region = remat.remat(f, policy="save_matmuls")
    assert torch.equal(torch.autograd.grad(region(x, w), w)[0], torch.autograd.grad(f(x, w), w)[0])
    out = torch.compile(region, backend="aot_eager")(x, w)
    with pytest.raises(RuntimeError, match="mutated"):
        out.backward()


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
    # Before torch 2.13, torch's checkpoint leaves its forward context (the selective
    # checkpoint mode that asked the policy) pushed when the region raises, until the
    # frames that hold it are collected; 2.13's closes it itself.
    gc.collect()
    assert not _get_current_dispatch_mode_stack()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_to_a_device_other_than_the_cpu_refuses_to_compile():
    """torch's offload under compile moves values to the CPU only: remat says so."""
    model = _model(remat.remat(policy=policies.offload("save_matmuls", device="cuda")))
    with pytest.raises(Exception, match="to the CPU only"):
        _steps(model, steps=1)


# Compiled autograd itself reads `.grad` of non-leaf tensors while it traces (torch 2.13).
NON_LEAF_GRAD = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not")


def _compiled_autograd_backward(model, backend="aot_eager"):
    """Loss and gradients of one eager forward whose backward compiled autograd runs."""
    from torch._dynamo import compiled_autograd

    x = _input()
    torch.manual_seed(100)
    model.zero_grad(set_to_none=True)
    loss = model(x)
    with compiled_autograd._enable(torch.compile(backend=backend)):
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


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

    counters.clear()
    loss, grads = _compiled_autograd_backward(_model(counted, attention=False))
    assert not counters["graph_break"]  # the unpacks are in the graph, as an opaque op
    plain_loss, plain_grads = _compiled_autograd_backward(_model(_plain, attention=False))
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert len(calls) == 6  # 3 forwards and 3 recomputes


@NON_LEAF_GRAD
def test_compiled_autograd_with_inductor_gives_its_plain_gradients_without_recompiling():
    """inductor reuses the memory of what an op returns: remat's unpack hands it copies
    (without them, gradients were wrong). Two backwards, one compile."""

    def backwards(wrap):
        torch._dynamo.reset()
        model = _model(wrap, attention=False)
        with torch._inductor.config.patch(compile_threads=1):
            first = _compiled_autograd_backward(model, backend="inductor")
            torch._dynamo.config.error_on_recompile = True
            try:
                second = _compiled_autograd_backward(model, backend="inductor")
            finally:
                torch._dynamo.config.error_on_recompile = False
        return first, second

    for (loss, grads), (plain_loss, plain_grads) in zip(
        backwards(remat.remat), backwards(_plain), strict=True
    ):
        assert torch.equal(loss, plain_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


@NON_LEAF_GRAD
def test_compiled_autograd_checks_kept_inputs_it_reads_without_a_recompute():
    """Only the first output's backward runs: it reads the region's inputs, kept by
    reference, and recomputes nothing. An input changed in place since the forward
    raises, as in eager mode, instead of giving a wrong gradient."""
    from torch._dynamo import compiled_autograd

    w = torch.randn(4, dtype=DTYPE, requires_grad=True)
    x = torch.randn(4, dtype=DTYPE)
    product, _ = remat.remat(lambda x, w: (x * w, (x * w).sin()))(x, w)
    x.add_(1)
    compiled = compiled_autograd._enable(torch.compile(backend="aot_eager"))
    with compiled, pytest.raises(Exception, match="modified in place between the forward"):
        product.sum().backward()


@NON_LEAF_GRAD
def test_per_op_policy_under_compiled_autograd_raises_naming_it():
    with pytest.raises(remat.RecomputeError, match=r"save_matmuls.*compiled autograd"):
        _compiled_autograd_backward(_model(remat.remat(policy="save_matmuls"), attention=False))


class _Mlp(nn.Module):
    """Wide enough that each block's input (128 KiB) stands out from allocator noise."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(128)
        self.up = nn.Linear(128, 512)
        self.down = nn.Linear(512, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _backward_peak(wrap, compiled: bool, retain: bool = False) -> tuple[int, list[torch.Tensor]]:
    """Peak bytes alive during one step's backward, counted from the start of its forward,
    from the profiler's memory events (they see allocations inside compiled code)."""
    from torch._dynamo import compiled_autograd
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    blocks = nn.ModuleList(_Mlp() for _ in range(8))
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))
    # One cycle; acc_events=True only keeps torch 2.11 and 2.12 from warning that it clears
    # events at the end of each cycle.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        for block in blocks:
            x = wrap(block)(x)
        loss = x.square().mean()
        with record_function("backward"):
            backend = torch.compile(backend="aot_eager")
            with compiled_autograd._enable(backend) if compiled else contextlib.nullcontext():
                loss.backward(retain_graph=retain)
                if retain:  # a second backward through the same graph, with its own peak
                    loss.backward()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    start = min(e.start_ns() for e in events if e.name() == "backward")
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for time, nbytes in memory:
        live += nbytes
        if time >= start:
            peak = max(peak, live)
    return peak, [p.grad for p in blocks.parameters()]


@NON_LEAF_GRAD
def test_compiled_autograd_keeps_eager_remats_backward_peak():
    """Compiled autograd holds what each pack hook returned until its graph returns; a pass
    that frees the graph lets remat release kept inputs once read, and hold a region's
    inputs weakly once it has recomputed. The backward peak then matches eager remat's
    (equal bytes here; 1.15x before that release)."""
    eager_plain, plain_grads = _backward_peak(_plain, compiled=False)
    eager, _ = _backward_peak(remat.remat, compiled=False)
    _backward_peak(remat.remat, compiled=True)  # compiles
    compiled, grads = _backward_peak(remat.remat, compiled=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert eager < 0.8 * eager_plain
    assert compiled <= 1.1 * eager, (compiled, eager)


@NON_LEAF_GRAD
def test_compiled_autograd_with_retain_graph_backward_twice_equals_eager():
    """A retained graph keeps every input, as eager autograd does: the second pass
    recomputes from them."""
    _, eager = _backward_peak(remat.remat, compiled=False, retain=True)
    _, compiled = _backward_peak(remat.remat, compiled=True, retain=True)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager, strict=True))


@NON_LEAF_GRAD
def test_compiled_autograd_backward_twice_without_retain_graph_raises():
    from torch._dynamo import compiled_autograd

    x = torch.randn(4, 8, requires_grad=True)
    loss = remat.remat(_Mlp())(torch.randn(4, 128) + x.sum()).sum()
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()


@NON_LEAF_GRAD
def test_compiled_autograd_second_output_after_a_freeing_pass_raises_or_uses_held_inputs():
    """The cost of letting go: after a backward that frees the graph, another backward
    through a second output of the same region finds its inputs only if something else
    holds them (a leaf does); an intermediate is gone, and remat says so (eager mode
    allows it)."""
    from torch._dynamo import compiled_autograd

    def two_outputs(h):
        return h.exp(), (h + 1).sin()  # the second path saves no input: h is the region's

    for intermediate in (False, True):
        x = torch.randn(4, requires_grad=True)
        h = x + 1 if intermediate else x  # (add saves nothing either)
        first, second = remat.remat(two_outputs)(h)
        del h
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            first.sum().backward()
            if intermediate:
                with pytest.raises(remat.RecomputeError, match="retain_graph=True"):
                    second.sum().backward()
            else:
                second.sum().backward()
                assert torch.allclose(x.grad, x.exp() + (x + 1).cos())

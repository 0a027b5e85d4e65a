"""Shared corpora for remat's tests: pytrees, random programs, transform stacks, comparisons.

Everything random is described by small frozen dataclasses (`TensorSpec`, `Op`, `Block`,
`Program`, `Case`) that hypothesis draws, prints and shrinks; `realize`, `build` and
`Case.make` turn a description into fresh tensors and callables, as often as a test needs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import reject, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from remat import policies
from remat.policies import Decision, OpCall

# `make test` draws the same examples on every run, so CI cannot turn red by chance;
# `make fuzz` (REMAT_FUZZ=n) draws fresh ones, n times as many.
FUZZ = int(os.environ.get("REMAT_FUZZ", "0"))


def examples(n: int) -> settings:
    """Hypothesis settings for ``n`` examples (``n * REMAT_FUZZ`` fresh ones when fuzzing)."""
    return settings(max_examples=n * max(FUZZ, 1), deadline=None, derandomize=not FUZZ)


@contextlib.contextmanager
def another_thread_alive() -> Any:
    """An idle thread for the block: regions then capture random numbers per op."""
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait)
    idle.start()
    try:
        yield
    finally:
        stop.set()
        idle.join()


def states_a_recompute_sees(policy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dropout region's second call (after its watched first): the CPU generator's state
    as its forward began, as its recompute began, and the caller's at the backward."""
    from remat import remat

    seen: list[torch.Tensor] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_rng_state())
        return F.dropout(x, 0.5).exp()

    x = torch.randn(8, requires_grad=True)
    region = remat(fn, policy=policy)
    region(x).sum().backward()  # the watched first call
    seen.clear()
    y = region(x).sum()
    caller = torch.get_rng_state()
    y.backward()
    assert len(seen) == 2
    assert torch.equal(torch.get_rng_state(), caller)
    return seen[0], seen[1], caller


@contextlib.contextmanager
def inductor_pool_alive() -> Any:
    """Inductor's compile pool with a worker running, as a compile with more than one
    thread leaves it for the process's life; yields the worker threads. Shut down after."""
    from torch._inductor.async_compile import AsyncCompile

    assert AsyncCompile.pool.cache_info().currsize == 0  # (the thread guard in conftest)
    with torch._inductor.config.patch(compile_threads=2):
        pool = AsyncCompile.pool()
    try:
        pool.submit(lambda: None).result()
        yield list(pool._threads)
    finally:
        pool.shutdown(wait=True)
        AsyncCompile.pool.cache_clear()


def run_alone(source: str, cwd: Any) -> list[str]:
    """The lines ``source`` prints, run in a process of its own (pytest's workers may keep
    threads alive), with ``tests`` importable after the installed remat."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).parent.parent)
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.append({root!r})" + source],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def step_with_idle_thread(f: Callable[..., Any], x: torch.Tensor, alive: str) -> torch.Tensor:
    """``y = f(x)`` and ``y.sum().backward()``, with an idle thread alive at the "forward",
    the "backward", "both" or "neither"; returns ``y``."""
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait)
    try:
        if alive in ("forward", "both"):
            idle.start()
        y = f(x)
        if alive == "forward":
            stop.set()
            idle.join()
        elif alive == "backward":
            idle.start()
        y.sum().backward()
    finally:
        stop.set()
        if idle.is_alive():
            idle.join()
    return y


DTYPE = torch.float64
NAMESPACE = "remat-tests"
# The devices the corpora run on (tests take them with `each_device`). A CUDA one is a CUDA
# test: make gpu-check runs it, and none may skip; conftest.py makes it deterministic.
DEVICES = [
    pytest.param("cpu"),
    *([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []),
]
each_device = pytest.mark.parametrize("device", DEVICES)


def identity(x: Any) -> Any:
    return x


# Pytrees --------------------------------------------------------------------------------------


class BasicBlock(torch.nn.Module):
    """torchvision's ResNet BasicBlock, small: batch norms, and an in-place ReLU at the end,
    which saves its output, the block's own."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = (torch.nn.Conv2d(4, 4, 3, padding=1) for _ in range(2))
        self.bn1, self.bn2 = torch.nn.BatchNorm2d(4), torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu_(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return torch.relu_(out)


class Marker:
    """A custom non-tensor leaf, meaningful only by identity."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return f"Marker({self.label!r})"


MARKER = Marker("program")


class Pair(NamedTuple):
    first: Any
    second: Any


class Box:
    """A pytree node registered only in `NAMESPACE`: to remat it is one opaque leaf."""

    __slots__ = ("content",)

    def __init__(self, content: Any) -> None:
        self.content = content

    def __repr__(self) -> str:
        return f"Box({self.content!r})"


optree.register_pytree_node(
    Box, lambda box: ((box.content,), None), lambda _, children: Box(*children), namespace=NAMESPACE
)

GRAD_KINDS = ("leaf", "const", "derived")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A recipe for a float64 tensor, the same numbers on every device.

    ``grad`` is ``"leaf"`` (a leaf that requires grad), ``"const"`` (no grad) or ``"derived"``
    (a non-leaf computed from a leaf that requires grad; that leaf is the gradient target).
    """

    shape: tuple[int, ...]
    seed: int
    grad: str = "leaf"

    def make(self, targets: list[torch.Tensor], device: str = "cpu") -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        t = torch.randn(self.shape, generator=generator, dtype=DTYPE).to(device)
        if self.grad == "const":
            return t
        t.requires_grad_()
        targets.append(t)
        return t if self.grad == "leaf" else t * 1.5


def realize(tree: Any, device: str = "cpu") -> tuple[Any, list[torch.Tensor]]:
    """Fresh tensors for every `TensorSpec` in ``tree``, and the leaves gradients must reach."""
    targets: list[torch.Tensor] = []
    made = optree.tree_map(
        lambda leaf: leaf.make(targets, device) if isinstance(leaf, TensorSpec) else leaf,
        tree,
        namespace=NAMESPACE,
    )
    return made, targets


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree``, looking inside `Box` too."""
    leaves = optree.tree_leaves(tree, namespace=NAMESPACE)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


SHAPES = st.sampled_from([(), (3,), (2, 3)])
GRADS = st.sampled_from(GRAD_KINDS)


def tensor_specs(
    shapes: st.SearchStrategy[tuple[int, ...]] = SHAPES,
    grads: st.SearchStrategy[str] = GRADS,
) -> st.SearchStrategy[TensorSpec]:
    return st.builds(TensorSpec, shapes, st.integers(0, 2**16), grads)


def non_tensor_leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.integers(-3, 2**40),
        st.sampled_from(["", "tag"]),
        st.sampled_from([0.5, -2.0, float("nan")]),
        st.builds(Marker, st.sampled_from("abc")),
    )


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """One level of every container kind remat accepts, around ``children``."""
    items = st.lists(children, max_size=3)
    dicts = st.dictionaries(st.sampled_from("abcd"), children, max_size=3)
    return st.one_of(
        items.map(tuple),
        items,
        dicts,
        dicts.map(collections.OrderedDict),
        dicts.map(functools.partial(collections.defaultdict, list)),
        items.map(collections.deque),
        items.map(lambda xs: collections.deque(xs, maxlen=len(xs) + 1)),
        st.builds(Pair, children, children),
        children.map(Box),
    )


def trees(leaves: st.SearchStrategy[Any], depth: int = 3) -> st.SearchStrategy[Any]:
    """Pytrees of ``leaves`` nested up to ``depth`` containers deep."""
    tree = leaves
    for _ in range(depth):
        tree = st.one_of(leaves, containers(tree))
    return tree


def spec_trees(
    specs: st.SearchStrategy[TensorSpec] | None = None, depth: int = 3
) -> st.SearchStrategy[Any]:
    """Pytrees mixing `TensorSpec` and non-tensor leaves; `realize` makes them concrete."""
    return trees(st.one_of(specs or tensor_specs(), non_tensor_leaves()), depth)


# Comparison -----------------------------------------------------------------------------------


def assert_tree_equal(actual: Any, expected: Any, tol: float = 0.0) -> None:
    """Same structure, bitwise-equal tensors (NaN equals NaN), and the same non-tensor objects.

    ``tol`` loosens the tensor comparison; callers that pass it say why.
    """
    actual_leaves, actual_spec = optree.tree_flatten(actual, namespace=NAMESPACE)
    expected_leaves, expected_spec = optree.tree_flatten(expected, namespace=NAMESPACE)
    assert actual_spec == expected_spec, f"structure {actual_spec} != {expected_spec}"
    paths = optree.tree_paths(expected, namespace=NAMESPACE)
    for path, a, e in zip(paths, actual_leaves, expected_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"at {path}: {a!r} is not a tensor"
            if tol:
                torch.testing.assert_close(a, e, rtol=tol, atol=tol, equal_nan=True)
            else:
                _assert_bitwise(a.detach(), e.detach(), path)
        else:
            assert a is e, f"at {path}: {a!r} is not the object {e!r}"


def _assert_bitwise(a: torch.Tensor, e: torch.Tensor, path: tuple[Any, ...]) -> None:
    torch.testing.assert_close(
        a, e, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"at {path}: {m}"
    )
    if e.is_floating_point():
        # assert_close takes -0.0 == 0.0; bitwise equality does not.
        assert torch.equal(a.signbit() & ~a.isnan(), e.signbit() & ~e.isnan()), (
            f"at {path}: signs of zeros differ"
        )


# Programs -------------------------------------------------------------------------------------

UNARY = ("sin", "exp", "tanh", "sigmoid", "relu", "square")
BINARY = ("add", "mul", "sub", "div", "matmul2", "cat_split")
SHAPED = ("matmul", "softmax", "layer_norm", "transpose", "reshape", "roll", "expand")
KINDS = (*UNARY, *BINARY, *SHAPED, "inplace", "inner_grad", "random")
FUNC_KINDS = tuple(kind for kind in KINDS if kind != "inner_grad")  # no autograd.grad in torch.func
# Ops with effects outside aten's dataflow: a Python branch on a value read out of a tensor,
# data-dependent split sizes (MoE routing), a closure cache filled by the first call, a closure
# state tensor updated in place (an EMA buffer), and an in-place write to an input of the
# program. Called twice in the same order on equal pools, a program does the same thing twice.
# `KINDS` leaves them out: only tests that say what they expect of them draw them.
EFFECT_KINDS = ("tolist_branch", "split_sizes", "cached", "buffer_update", "inplace_input")
ALL_KINDS = (*KINDS, *EFFECT_KINDS)
# What torch.func runs of them. No transform mutates a captured tensor (buffer_update); its
# input is a leaf that requires grad, so inplace_input would only write to a clone; under
# vmap no Python value can be read out of a batched tensor (tolist_branch, split_sizes), and
# under grad no tensor's memory either (tolist_branch's "numpy" read: see `reads_memory`).
FUNC_EFFECT_KINDS = {"grad": ("tolist_branch", "split_sizes", "cached"), "vmap_grad": ("cached",)}
OUTPUTS = ("last", "tuple", "dict", "mirror", "scalar")

# In-place steps on a fresh clone. `relu_` saves its result, so only the last step may be one.
CHAIN_STEPS = ("mul_s", "add_t", "sub_t", "mul_t", "div_t", "clamp_", "addcmul_")
LAST_STEPS = ("relu_",)
VIEWS = ("whole", "cols", "t", "row")
# Where a random op draws from (see `_random`).
RANDOMS = ("dropout", "rand_like", "bernoulli_", "uniform_", "randn", "rand_on", "generator")
# How tolist_branch reads a Python number out of a tensor.
READS = ("tolist", "item", "numpy")
# In-place writes of inplace_input to an input of the program (or to a clone: see `_ops`).
INPUT_STEPS = ("mul_", "add_", "add_w", "clamp_")


@dataclasses.dataclass(frozen=True)
class Op:
    """``pool.append(kind(*pool[args], param))``."""

    kind: str
    args: tuple[int, ...]
    param: Any = None


@dataclasses.dataclass(frozen=True)
class Block:
    """A sub-program over ``pool[args]``, built once as its own (possibly remat'd) function."""

    args: tuple[int, ...]
    body: tuple[Op | Block, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """A chain of ops on (n, n) float64 tensors.

    The pool of values starts as the tensor leaves of ``(args, kwargs)``; each op appends one.
    ``out`` picks the result's shape. The program reads closure tensors made from ``seed``:
    ``w``, ``gamma``, ``beta`` (requiring grad) and ``c`` (not), and its random ops may draw
    from a generator of its own, also seeded from ``seed``.
    """

    n: int
    ops: tuple[Op | Block, ...]
    out: str = "last"
    seed: int = 0


class Params(NamedTuple):
    """The closure of a built program.

    ``cache`` is filled by its cached ops' first call; ``buffers`` are the state tensors of
    its buffer_update ops, a buffer and a parameter of the module ``state`` (the op at
    hand's), read through it as a model reads them; ``holders`` are those modules, in a
    plain list: regions reach them only through containers (this list, and this tuple).
    ``generator`` is the program's own, for random ops that pass ``generator=``.
    """

    w: torch.Tensor
    c: torch.Tensor
    gamma: torch.Tensor
    beta: torch.Tensor
    cache: dict[str, torch.Tensor]
    buffers: list[torch.Tensor]
    holders: list[torch.nn.Module]
    generator: torch.Generator
    state: torch.nn.Module | None = None

    @property
    def trainable(self) -> list[torch.Tensor]:
        return [self.w, self.gamma, self.beta, *(h.scale for h in self.holders)]


def make_params(n: int, seed: int, device: str = "cpu") -> Params:
    generator = torch.Generator().manual_seed(seed)
    w, c = (torch.randn(n, n, generator=generator, dtype=DTYPE).to(device) for _ in range(2))
    gamma, beta = (torch.randn(n, generator=generator, dtype=DTYPE).to(device) for _ in range(2))
    return Params(
        w.requires_grad_(),
        c,
        gamma.requires_grad_(),
        beta.requires_grad_(),
        {},
        [],
        [],
        torch.Generator(device).manual_seed(seed + 1),
    )


def _view(t: torch.Tensor, view: str) -> torch.Tensor:
    if view == "cols":
        return t[:, 1:]
    if view == "t":
        return t.t()
    if view == "row":
        return t[0]
    return t


_STEPS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "mul_s": lambda v, o: v.mul_(1.5),
    "add_t": lambda v, o: v.add_(o),
    "sub_t": lambda v, o: v.sub_(o),
    "mul_t": lambda v, o: v.mul_(o),
    "div_t": lambda v, o: v.div_(o * o + 1),
    "clamp_": lambda v, o: v.clamp_(-0.5, 0.5),
    "addcmul_": lambda v, o: v.addcmul_(o, o, value=0.5),
    "relu_": lambda v, o: v.relu_(),
}


def _inplace(a: torch.Tensor, b: torch.Tensor, param: tuple[str, tuple[str, ...]]) -> torch.Tensor:
    view, steps = param
    fresh = a.clone()
    target, operand = _view(fresh, view), _view(b, view)
    for step in steps:
        _STEPS[step](target, operand)
    return fresh


def _inner_grad(a: torch.Tensor, create_graph: bool, p: Params) -> torch.Tensor:
    h = a + p.w
    wrt = [h, a] if a.requires_grad else [h]
    grads = torch.autograd.grad(h.tanh().pow(3).sum(), wrt, create_graph=create_graph)
    return sum(grads) * h


def _cat_split(a: torch.Tensor, b: torch.Tensor, param: tuple[int, int]) -> torch.Tensor:
    dim, k = param
    n = a.shape[dim]
    head, tail = torch.cat([a, b], dim).split([k, 2 * n - k], dim)
    return torch.cat([tail, head], dim).narrow(dim, 0, n)


def _matmul(a: torch.Tensor, which: str, p: Params) -> torch.Tensor:
    if which == "wt":
        return a @ p.w.t()
    return a @ (p.w if which == "w" else p.c)


def _layer_norm(a: torch.Tensor, affine: bool, p: Params) -> torch.Tensor:
    n = a.shape[-1]
    return F.layer_norm(a, (n,), p.gamma, p.beta) if affine else F.layer_norm(a, (n,))


def _tolist_branch(a: torch.Tensor, read: str) -> torch.Tensor:
    if read == "item":
        first = (a + 1).sum().item()
    elif read == "numpy":
        t = (a + 1).detach()
        first = float((t.cpu() if t.is_cuda else t).numpy().flat[0])
    else:
        first = (a + 1).tolist()
        while isinstance(first, list):
            first = first[0]
    return a.sin() if first > 0 else a.cos()


def _split_sizes(a: torch.Tensor, routed: bool, p: Params) -> torch.Tensor:
    """Rows routed to two experts (``@ w`` and ``sin``), split by sizes read from the data."""
    route = (a.detach().sum(-1) > 0).long()
    sizes = torch.bincount(route, minlength=2).tolist()
    order = torch.argsort(route, stable=True) if routed else None
    first, second = (a if order is None else a[order]).split(sizes)
    out = torch.cat([first @ p.w, second.sin()])
    return out if order is None else out[torch.argsort(order)]


def _cached(a: torch.Tensor, how: str, p: Params) -> torch.Tensor:
    mask = p.cache.get("mask")
    if mask is None:  # the first call builds it; every later call (and recompute) reuses it
        n = a.shape[-1]
        mask = p.cache["mask"] = torch.ones(n, n, dtype=a.dtype, device=a.device).tril()
    return a.masked_fill(mask == 0, 0.0) if how == "masked_fill" else a * mask


def _buffer_update(a: torch.Tensor, param: tuple[str, str], p: Params) -> torch.Tensor:
    """``a`` plus (or times) module state the op updates first: its buffer in place or by
    ``.data`` assignment, or its parameter in place (then read, as ``nn.Embedding``'s
    ``max_norm`` does)."""
    how, update = param
    holder = p.state
    assert holder is not None
    mean = a.detach().mean()
    with torch.no_grad():
        if update == "data":
            holder.ema.data = holder.ema.data * 0.5 + mean
        else:
            (holder.scale if update == "parameter" else holder.ema).mul_(0.5).add_(mean)
    state = holder.scale if update == "parameter" else holder.ema
    return a + state if how == "add" else a * state


_INPUT_STEPS: dict[str, Callable[[torch.Tensor, Params], Any]] = {
    "mul_": lambda v, p: v.mul_(0.5),
    "add_": lambda v, p: v.add_(1.0),
    "add_w": lambda v, p: v.add_(p.w),
    "clamp_": lambda v, p: v.clamp_(-0.5, 0.5),
}


def _random(a: torch.Tensor, source: str, p: Params) -> torch.Tensor:
    """``a`` times random numbers (or dropped out); ``source`` says how they are drawn.

    No backward needs ``a.neg()``, so a recompute may skip it: the random op that reads only
    its layout (or device) must still draw the forward's numbers.
    """
    if source == "dropout":
        return F.dropout(a, 0.5, training=True)
    if source == "rand_like":  # reads only the layout of a.neg()
        return (torch.rand_like(a.neg()) + 1) * a
    if source == "bernoulli_":  # in place, on a fresh tensor
        return torch.empty_like(a).bernoulli_(0.5) * a
    if source == "uniform_":
        return torch.empty_like(a).uniform_(-1, 1) * a
    if source == "randn":  # a factory: no tensor argument at all (the CPU generator's)
        return torch.randn(a.shape, dtype=a.dtype).to(a.device) * a
    if source == "rand_on":  # a factory on the device of a.neg()
        return (torch.rand(a.shape, dtype=a.dtype, device=a.neg().device) + 1) * a
    g = p.generator  # not the global one
    return torch.rand(a.shape, dtype=a.dtype, device=g.device, generator=g) * a


def _inplace_input(a: torch.Tensor, param: tuple[bool, str], p: Params) -> torch.Tensor:
    """Write to ``a`` itself if ``param`` says so and autograd allows it, else to a clone."""
    in_place, step = param
    target = a if in_place and not (a.is_leaf and a.requires_grad) else a.clone()
    _INPUT_STEPS[step](target, p)
    return target


_OPS: dict[str, Callable[[Sequence[torch.Tensor], Any, Params], torch.Tensor]] = {
    "sin": lambda xs, _, p: torch.sin(xs[0]),
    "exp": lambda xs, _, p: torch.exp(xs[0]),
    "tanh": lambda xs, _, p: torch.tanh(xs[0]),
    "sigmoid": lambda xs, _, p: torch.sigmoid(xs[0]),
    "relu": lambda xs, _, p: torch.relu(xs[0]),
    "square": lambda xs, _, p: torch.square(xs[0]),
    "add": lambda xs, _, p: xs[0] + xs[1],
    "mul": lambda xs, _, p: xs[0] * xs[1],
    "sub": lambda xs, _, p: xs[0] - xs[1],
    "div": lambda xs, _, p: xs[0] / (xs[1] * xs[1] + 1),
    "matmul2": lambda xs, _, p: xs[0] @ xs[1],
    "cat_split": lambda xs, param, p: _cat_split(xs[0], xs[1], param),
    "matmul": lambda xs, param, p: _matmul(xs[0], param, p),
    "softmax": lambda xs, param, p: torch.softmax(xs[0], dim=param),
    "layer_norm": lambda xs, param, p: _layer_norm(xs[0], param, p),
    "transpose": lambda xs, _, p: xs[0].transpose(0, 1),
    "reshape": lambda xs, _, p: xs[0].reshape(-1).view(xs[0].shape),
    "roll": lambda xs, k, p: torch.cat([xs[0][k:], xs[0][:k]]),
    "expand": lambda xs, k, p: xs[0][:, k : k + 1].expand(xs[0].shape),
    "inplace": lambda xs, param, p: _inplace(xs[0], xs[1], param),
    "inner_grad": lambda xs, create_graph, p: _inner_grad(xs[0], create_graph, p),
    "tolist_branch": lambda xs, read, p: _tolist_branch(xs[0], read),
    "split_sizes": lambda xs, routed, p: _split_sizes(xs[0], routed, p),
    "cached": lambda xs, how, p: _cached(xs[0], how, p),
    "buffer_update": lambda xs, how, p: _buffer_update(xs[0], how, p),
    "inplace_input": lambda xs, param, p: _inplace_input(xs[0], param, p),
    "random": lambda xs, source, p: _random(xs[0], source, p),
}
_ARITY = {kind: 2 if kind in (*BINARY, "inplace") else 1 for kind in ALL_KINDS}

Step = Callable[[list[torch.Tensor]], None]


def _compile(ops: Sequence[Op | Block], params: Params, wrap: Callable[..., Any]) -> list[Step]:
    return [_compile_one(op, params, wrap) for op in ops]


def _compile_one(op: Op | Block, params: Params, wrap: Callable[..., Any]) -> Step:
    if isinstance(op, Block):
        steps = _compile(op.body, params, wrap)
        generator = params.generator  # see `build_with_params`

        def block(*xs: torch.Tensor) -> torch.Tensor:
            assert generator is not None
            pool = list(xs)
            for step in steps:
                step(pool)
            return pool[-1]

        sub = wrap(block)
        return lambda pool: pool.append(sub(*(pool[i] for i in op.args)))
    run = _OPS[op.kind]
    if op.kind == "buffer_update":  # each such op owns a module with its state
        holder = torch.nn.Module()
        holder.register_buffer("ema", params.c.clone())
        holder.scale = torch.nn.Parameter(params.gamma.detach().clone())
        params.holders.append(holder)
        params.buffers.extend([holder.ema, holder.scale])
        params = params._replace(state=holder)
    return lambda pool: pool.append(run([pool[i] for i in op.args], op.param, params))


def _outputs(out: str, pool: list[torch.Tensor], args: Any, kwargs: Any) -> Any:
    if out == "tuple":
        return (pool[-1], [pool[len(pool) // 2], None], MARKER)
    if out == "dict":
        return {"out": pool[-1], "aux": {"first": pool[0], "label": "tag", "count": 3}, "m": MARKER}
    if out == "mirror":
        picks = itertools.cycle(reversed(pool))
        return optree.tree_map(
            lambda leaf: next(picks) if isinstance(leaf, torch.Tensor) else leaf,
            (args, kwargs),
            namespace=NAMESPACE,
        )
    if out == "scalar":
        return sum(v.sum() for v in pool)
    return pool[-1]


def build(
    program: Program, wrap: Callable[..., Any] = identity, device: str = "cpu"
) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """A fresh callable for ``program``, and its closure tensors that require grad.

    ``wrap`` is applied to every `Block` (pass `remat` for nested regions).
    """
    fn, params = build_with_params(program, wrap, device)
    return fn, params.trainable


def build_with_params(
    program: Program, wrap: Callable[..., Any] = identity, device: str = "cpu"
) -> tuple[Callable[..., Any], Params]:
    """`build`, with the whole closure: buffer_update's buffers and the program's generator too."""
    params = make_params(program.n, program.seed, device)
    steps = _compile(program.ops, params, wrap)
    holders = params.holders  # modules `fn` reaches by closure, as a model's
    # fn and blocks name the program's generator, as a model would: remat captures only the
    # generators a region can see (docs/rng.md#which-generators); a closure cell is one way.
    generator = params.generator

    def fn(*args: Any, **kwargs: Any) -> Any:
        assert holders is not None
        assert generator is not None
        pool = tensor_leaves((args, kwargs))
        for step in steps:
            step(pool)
        return _outputs(program.out, pool, args, kwargs)

    return fn, params


def program_ops(ops: Program | Sequence[Op | Block]) -> list[Op]:
    """Every `Op` of a program, blocks' bodies included."""
    found: list[Op] = []
    for op in ops.ops if isinstance(ops, Program) else ops:
        found.extend(program_ops(op.body) if isinstance(op, Block) else [op])
    return found


def writes_inputs(program: Program) -> bool:
    """Whether ``program`` may modify one of its arguments in place (an inplace_input op)."""
    return any(
        isinstance(op, Op) and op.kind == "inplace_input" and op.param[0] for op in program.ops
    )


def reads_memory(program: Program) -> bool:
    """Whether ``program`` reads a tensor's memory directly (``.numpy()``), as torch.func can't."""
    return any(op.kind == "tolist_branch" and op.param == "numpy" for op in program_ops(program))


def _param(draw: st.DrawFn, kind: str, n: int) -> Any:
    if kind == "matmul":
        return draw(st.sampled_from(("w", "c", "wt")))
    if kind == "softmax":
        return draw(st.sampled_from((0, 1)))
    if kind in ("layer_norm", "inner_grad"):
        return draw(st.booleans())
    if kind == "cat_split":
        return draw(st.tuples(st.sampled_from((0, 1)), st.integers(1, 2 * n - 1)))
    if kind == "roll":
        return draw(st.integers(1, n - 1))
    if kind == "expand":
        return draw(st.integers(0, n - 1))
    if kind == "tolist_branch":
        return draw(st.sampled_from(READS))
    if kind == "split_sizes":
        return draw(st.booleans())
    if kind == "random":
        return draw(st.sampled_from(RANDOMS))
    if kind == "cached":
        return draw(st.sampled_from(("masked_fill", "mul")))
    if kind == "buffer_update":
        how = draw(st.sampled_from(("add", "mul")))
        return how, draw(st.sampled_from(("in_place", "data", "parameter")))
    if kind == "inplace":
        view = draw(st.sampled_from(VIEWS))
        chain = draw(st.lists(st.sampled_from(CHAIN_STEPS), min_size=1, max_size=3))
        last = draw(st.lists(st.sampled_from(LAST_STEPS), max_size=1))
        return view, (*chain, *last)
    return None


def _operand(draw: st.DrawFn, size: int) -> int:
    """An index into a pool of ``size`` values, shrinking toward the newest."""
    return size - 1 - draw(st.integers(0, size - 1))


@st.composite
def _ops(
    draw: st.DrawFn,
    n: int,
    size: int,
    kinds: tuple[str, ...],
    max_ops: int,
    block_depth: int,
    required: tuple[str, ...] = (),
    writable: bool = True,
) -> tuple[Op | Block, ...]:
    """Ops on a pool of ``size`` values, of which the first ``size`` are the inputs.

    An inplace_input op writes to an input in place only where that is sound for autograd:
    ``writable`` (not in a block, whose inputs may alias) and no earlier op read it (which
    could have saved it); otherwise it writes to a clone.
    """
    count = draw(st.integers(len(required), max(max_ops, len(required))))
    order = draw(st.permutations(range(count)))
    forced = dict(zip(order, required, strict=False))
    choices = (*kinds, "block") if block_depth else kinds
    inputs, read = size, set()
    ops: list[Op | Block] = []
    for i in range(count):
        kind = forced.get(i) or draw(st.sampled_from(choices))
        if kind == "block":
            arity = draw(st.integers(1, 2))
            args = tuple(_operand(draw, size) for _ in range(arity))
            body = draw(_ops(n, arity, kinds, 3, block_depth - 1, writable=False))
            ops.append(Block(args, body))
        elif kind == "inplace_input":
            args = (draw(st.integers(0, inputs - 1)),)
            step = draw(st.sampled_from(INPUT_STEPS))
            ops.append(Op(kind, args, (writable and args[0] not in read, step)))
        else:
            args = tuple(_operand(draw, size) for _ in range(_ARITY[kind]))
            ops.append(Op(kind, args, _param(draw, kind, n)))
        read.update(args)
        size += 1
    return tuple(ops)


def programs(
    n: int,
    inputs: int,
    *,
    kinds: tuple[str, ...] = KINDS,
    max_ops: int = 6,
    block_depth: int = 2,
    required: tuple[str, ...] = (),
    outputs: tuple[str, ...] = OUTPUTS,
) -> st.SearchStrategy[Program]:
    """Programs on ``inputs`` tensors of shape (n, n); ``required`` kinds appear at least once.

    A kind of ``"block"`` is a nested sub-program, up to ``block_depth`` blocks deep.
    """
    return st.builds(
        Program,
        st.just(n),
        _ops(n, inputs, kinds, max_ops, block_depth, required),
        st.sampled_from(outputs),
        st.integers(0, 2**16),
    )


@dataclasses.dataclass
class Instance:
    """A callable with fresh arguments, and every tensor its gradients must reach.

    ``state`` holds the closure tensors ``fn`` updates in place (buffer_update's buffers);
    ``generators`` the generators other than the global one that ``fn`` may draw from.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    targets: list[torch.Tensor]
    state: list[torch.Tensor] = dataclasses.field(default_factory=list)
    generators: list[torch.Generator] = dataclasses.field(default_factory=list)

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class Case:
    """Argument recipes and a program; `make` builds a fresh `Instance` from them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    program: Program

    def make(
        self,
        outer: Callable[..., Any] = identity,
        inner: Callable[..., Any] = identity,
        device: str = "cpu",
    ) -> Instance:
        """``outer`` wraps the whole program, ``inner`` each of its blocks."""
        (args, kwargs), targets = realize((self.args, self.kwargs), device)
        fn, params = build_with_params(self.program, inner, device)
        return Instance(
            outer(fn), args, kwargs, targets + params.trainable, params.buffers, [params.generator]
        )


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    kinds: tuple[str, ...] = KINDS,
    required: tuple[str, ...] = (),
    max_ops: int = 6,
    block_depth: int = 2,
) -> Case:
    """A program called as ``fn(x, tree, **maybe {"extra": tree})`` on (n, n) tensor leaves."""
    n = draw(st.integers(2, 4))
    specs = tensor_specs(st.just((n, n)))
    leaves = st.one_of(specs, non_tensor_leaves())
    args = (draw(specs), draw(trees(leaves, 2)))
    kwargs = draw(st.one_of(st.just({}), st.fixed_dictionaries({"extra": trees(leaves, 2)})))
    count = len(
        [
            leaf
            for leaf in optree.tree_leaves((args, kwargs), namespace=NAMESPACE)
            if isinstance(leaf, TensorSpec)
        ]
    )
    program = draw(
        programs(n, count, kinds=kinds, max_ops=max_ops, block_depth=block_depth, required=required)
    )
    return Case(args, kwargs, program)


# Policies -------------------------------------------------------------------------------------

aten = torch.ops.aten

# Every kind of policy remat takes, by a name `pytest -k` accepts: the named ones, the objects
# of `remat.policies`, and their combinations. No program calls `remat.name`, so the name
# policies decide by op alone: save_names keeps nothing, save_all_but_names everything,
# both through the per-op machinery (unlike "save_nothing" and "save_everything").
POLICIES: dict[str, Any] = {
    "save_nothing": "save_nothing",
    "save_everything": "save_everything",
    "save_matmuls": "save_matmuls",
    "save_matmuls_no_batch": "save_matmuls_no_batch",
    "save_ops:mm+add": policies.save_ops(aten.mm, aten.add),
    "save_ops:sin+exp+tanh.default": policies.save_ops(aten.sin, aten.exp, aten.tanh.default),
    "save_names:h": policies.save_names("h"),
    "save_all_but_names:h": policies.save_all_but_names("h"),
    "offload:save_matmuls": policies.offload(policies.save_matmuls),
    "save_matmuls_or_save_ops:sin": policies.save_matmuls | policies.save_ops(aten.sin),
    "save_everything_and_save_ops:mm+add": policies.save_everything
    & policies.save_ops(aten.mm, aten.add),
    "offload:save_ops:mul_or_save_ops:cat": policies.offload(policies.save_ops(aten.mul))
    | policies.save_ops(aten.cat),
    "memory_budget:0.3": policies.memory_budget(0.3),
    "memory_budget:0.7": policies.memory_budget(0.7),
    "offload:memory_budget:0.5": policies.offload(policies.memory_budget(0.5)),
}

# Ops the programs run (and a few they don't), for `custom_policies` to decide on.
POLICY_OPS = (
    aten.mm,
    aten.add,
    aten.sub,
    aten.mul,
    aten.div,
    aten.sin,
    aten.cos,
    aten.exp,
    aten.tanh,
    aten.sigmoid,
    aten.cat,
    aten.clone,
    aten._softmax,
    aten.native_layer_norm,
    aten.masked_fill,
    aten.index,
    # The random kind's: its draws, and the value whose layout alone rand_like reads.
    aten.bernoulli_,
    aten.uniform_,
    aten.rand_like,
    aten.rand,
    aten.randn,
    aten.neg,
)


class CustomPolicy:
    """A user's policy callable: ``decisions`` for some aten op packets, ``default`` for the rest.

    Not a dataclass, so that hypothesis prints it by its repr.
    """

    __slots__ = ("decisions", "default")

    def __init__(
        self, decisions: tuple[tuple[Any, Decision], ...], default: Decision = Decision.RECOMPUTE
    ) -> None:
        self.decisions, self.default = decisions, default

    def __call__(self, call: OpCall) -> Decision:
        packet = getattr(call.op, "overloadpacket", call.op)
        return next((d for op, d in self.decisions if op == packet), self.default)

    @property
    def __name__(self) -> str:  # remat's repr of a custom policy is its ``__name__``
        return repr(self)

    def __repr__(self) -> str:
        rules = ", ".join(f"{str(op).removeprefix('aten.')}={d.name}" for op, d in self.decisions)
        return f"custom({rules}{', ' if rules else ''}else={self.default.name})"


@st.composite
def custom_policies(draw: st.DrawFn) -> CustomPolicy:
    """Random per-op policy callables returning `Decision`s; they shrink toward recomputing."""
    decisions = st.sampled_from(tuple(Decision))
    table = draw(st.dictionaries(st.sampled_from(POLICY_OPS), decisions, max_size=8))
    return CustomPolicy(tuple(table.items()), draw(decisions))


# Eager autograd modes -------------------------------------------------------------------------


def loss_of(out: Any, cos: bool = False) -> torch.Tensor | None:
    """A scalar mixing every output tensor that requires grad, or None if there is none."""
    tensors = [t for t in tensor_leaves(out) if t.requires_grad]
    if not tensors:
        return None
    mix = torch.cos if cos else torch.sin
    return sum(((i + 1) * mix(t)).sum() for i, t in enumerate(tensors))


def _grads(targets: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in targets]


def _subset(targets: list[torch.Tensor]) -> list[torch.Tensor]:
    assert len(targets) >= 2
    return targets[::2]


# Programs draw random numbers (the random kind), so runs compared must start from the same
# global RNG state; and where the generators end is part of what remat must match.
RNG_SEED = 0


def from_seed(
    run: Callable[[], Any], generators: Sequence[torch.Generator] = ()
) -> tuple[Any, list[torch.Tensor]]:
    """``run()`` from the global generators seeded with `RNG_SEED`, then every generator's
    state (the default CUDA generator's too, where there is one)."""
    torch.manual_seed(RNG_SEED)
    result = run()
    return result, [*global_rng_states(), *(g.get_state() for g in generators)]


def global_rng_states() -> list[torch.Tensor]:
    """The states of the default CPU generator and, where CUDA is, the current device's."""
    cuda = [torch.cuda.get_rng_state()] if torch.cuda.is_available() else []
    return [torch.get_rng_state(), *cuda]


def _seeded(run: Callable[[Instance], tuple[Any, ...]]) -> Callable[[Instance], tuple[Any, ...]]:
    """An eager mode's runner, run `from_seed`; the generators' states come last."""

    @functools.wraps(run)
    def seeded(inst: Instance) -> tuple[Any, ...]:
        result, states = from_seed(lambda: run(inst), inst.generators)
        return (*result, states)

    return seeded


@_seeded
def run_outputs(inst: Instance) -> Any:
    out = inst()
    return out, [t.requires_grad for t in tensor_leaves(out)]


@_seeded
def run_backward(inst: Instance) -> Any:
    out = inst()
    loss = loss_of(out)
    if loss is not None:
        loss.backward()
    return out, _grads(inst.targets)


@_seeded
def run_backward_inputs(inst: Instance) -> Any:
    out = inst()
    loss = loss_of(out)
    if loss is not None:
        loss.backward(inputs=_subset(inst.targets))
    return out, _grads(inst.targets)


@_seeded
def run_grad(inst: Instance) -> Any:
    out = inst()
    loss = loss_of(out)
    if loss is None:
        return out, None
    return out, torch.autograd.grad(loss, inst.targets, allow_unused=True)


@_seeded
def run_grad_subset(inst: Instance) -> Any:
    out = inst()
    loss = loss_of(out)
    if loss is None:
        return out, None
    return out, torch.autograd.grad(loss, _subset(inst.targets), allow_unused=True)


@_seeded
def run_retain_graph(inst: Instance) -> Any:
    out = inst()
    loss = loss_of(out)
    if loss is None:
        return out, None
    loss.backward(retain_graph=True)
    first = _grads(inst.targets)
    loss.backward(retain_graph=True)
    other = torch.autograd.grad(loss_of(out, cos=True), inst.targets, allow_unused=True)
    return out, first, _grads(inst.targets), other


@_seeded
def run_create_graph(inst: Instance) -> Any:
    out = inst()
    loss = loss_of(out)
    if loss is None:
        return out, None
    grads = torch.autograd.grad(loss, inst.targets, create_graph=True, allow_unused=True)
    live = [g for g in grads if g is not None and g.requires_grad]
    if not live:
        return out, grads, None
    total = sum(g.sum() for g in live)
    return out, grads, torch.autograd.grad(total, inst.targets, allow_unused=True)


# torch 2.11's CUDA autograd (seen on an H200) raises this, by chance, in the second-order
# backward through the CopySlices that relu_ on a view leaves. Plain torch, no remat anywhere,
# failed in 2 to 6 of 6 runs of one program in a process (the docstring below). remat's
# recompute runs the same ops and meets it too. Such a run has no reference to compare with.
TORCH_CUDA_FREED = "Trying to backward through the graph a second time"


def relu_on_a_view(program: Program) -> bool:
    """Whether ``program`` runs ``relu_`` in place on a view (an inplace op not on the whole)."""
    return any(
        op.kind == "inplace" and op.param[0] != "whole" and "relu_" in op.param[1]
        for op in program_ops(program)
    )


@contextlib.contextmanager
def unless_torch_cuda_fails(program: Program, device: str) -> Any:
    """Reject the example where torch itself fails (`TORCH_CUDA_FREED`); raise anything else.

    The plain program: ``x`` (2 x 2, float64, made on the CPU and moved), ``a = x.sin()``,
    ``f = a.clone()``, ``f[:, 1:].mul_(1.5).relu_()``, ``g = grad(f.sin().sum(), x,
    create_graph=True)``, then ``grad(g.sum(), x)``: on CUDA under torch 2.11 it raises in
    some runs (with ``x`` made on CUDA, in none of 30).
    """
    try:
        yield
    except RuntimeError as error:
        if device == "cuda" and TORCH_CUDA_FREED in str(error) and relu_on_a_view(program):
            reject()
        raise


EAGER_MODES: dict[str, Callable[[Instance], Any]] = {
    "outputs": run_outputs,
    "backward": run_backward,
    "backward_inputs": run_backward_inputs,
    "grad": run_grad,
    "grad_subset": run_grad_subset,
    "retain_graph": run_retain_graph,
    "create_graph": run_create_graph,
}


# torch.func transform stacks ------------------------------------------------------------------


def _vjp(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Any]:
    def run(x: torch.Tensor) -> Any:
        out, vjp_fn = torch.func.vjp(f, x)
        return out, vjp_fn(torch.ones_like(out))

    return run


def _jvp(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Any]:
    return lambda x: torch.func.jvp(f, (x,), (torch.ones_like(x),))


def _grad_grad(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Any]:
    return torch.func.grad(lambda x: torch.func.grad(f)(x).sum())


# Each takes f: Tensor -> scalar Tensor and returns a function of the same x (with a leading
# batch dimension for the names in BATCHED). A vmap raises on random ops unless told how to
# draw: each example its own numbers under vmap_grad; under jacfwd every column of one
# Jacobian must see the same numbers.
STACKS: dict[str, Callable[[Callable[[torch.Tensor], torch.Tensor]], Callable[..., Any]]] = {
    "grad": torch.func.grad,
    "vmap_grad": lambda f: torch.func.vmap(torch.func.grad(f), randomness="different"),
    "grad_grad": _grad_grad,
    "vjp": _vjp,
    "jacrev": torch.func.jacrev,
    "hessian": torch.func.hessian,
    "jacfwd": functools.partial(torch.func.jacfwd, randomness="same"),
    "jvp": _jvp,
}
# hessian's inner jacfwd vmaps with randomness="error", and hessian has no way to change it.
NO_RANDOM_STACKS = frozenset({"hessian"})
BATCHED = frozenset({"vmap_grad"})


def scalar_of(out: Any) -> torch.Tensor:
    """A scalar mixing every output tensor, for transforms that need ``f: x -> scalar``."""
    tensors = tensor_leaves(out)
    return sum(((i + 1) * t.sin()).sum() for i, t in enumerate(tensors))


@st.composite
def func_programs(
    draw: st.DrawFn, *, max_ops: int = 6, block_depth: int = 2, kinds: tuple[str, ...] = FUNC_KINDS
) -> Program:
    """Programs of one (n, n) tensor, without ops torch.func cannot run (autograd.grad)."""
    n = draw(st.integers(2, 4))
    return draw(programs(n, 1, kinds=kinds, max_ops=max_ops, block_depth=block_depth))


def draws_random(program: Program) -> bool:
    """Whether ``program`` has a random op, in a block or not."""
    return any(op.kind == "random" for op in program_ops(program))


def run_stack(
    stack: str,
    program: Program,
    x: torch.Tensor,
    outer: Callable[..., Any] = identity,
    inner: Callable[..., Any] = identity,
) -> tuple[Any, list[torch.Tensor]]:
    """``STACKS[stack]`` of ``x -> scalar_of(outer(program)(x))`` at ``x``, run `from_seed`.

    ``inner`` wraps each block.
    """
    fn, params = build_with_params(program, inner, x.device.type)
    region = outer(fn)
    transformed = STACKS[stack](lambda x: scalar_of(region(x)))
    return from_seed(lambda: transformed(x), [params.generator])


def assert_stack_equal(
    stack: str,
    program: Program,
    x: torch.Tensor,
    outer: Callable[..., Any],
    inner: Callable[..., Any] = identity,
    tolerance: float = 0.0,
) -> None:
    """`run_stack` with ``outer`` and ``inner`` gives what it gives plain; where plain
    raises (vmap's fallback refuses ``relu_`` on a view of a leaf), the same error.

    ``tolerance`` is relative to the largest value plain's ops computed (at least 1): the
    terms a result sums, whose rounding it carries.
    """
    largest = Largest()
    try:
        # (Only where it is needed: a dispatch mode around hessian crashes torch 2.13.)
        with largest if tolerance else contextlib.nullcontext():
            expected = run_stack(stack, program, x)
    except RuntimeError as error:
        with pytest.raises(type(error), match=re.escape(str(error))):
            run_stack(stack, program, x, outer, inner)
        return
    tolerance *= max(1.0, largest.value)
    assert_tree_equal(run_stack(stack, program, x, outer, inner), expected, tolerance)


def import_benchmark(name: str) -> Any:
    """``benchmarks.<name>`` from the repository, while tests import the installed remat."""
    import importlib
    from pathlib import Path

    import pytest

    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        return importlib.import_module(f"benchmarks.{name}")


class Largest(TorchDispatchMode):
    """The largest finite magnitude among the floating values ops compute while active."""

    def __init__(self) -> None:
        super().__init__()
        self.value = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                finite = t.detach().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
                self.value = max(self.value, finite.max().item())
        return out


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run while active, by name (``"aten.mm"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

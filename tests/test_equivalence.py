"""Equivalence: `remat(fn)` computes bitwise what `fn` computes, outputs and gradients alike,
on each device of `DEVICES`."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption

from remat import remat
from tests.helpers import (
    BATCHED,
    DTYPE,
    EAGER_MODES,
    NAMESPACE,
    NO_RANDOM_STACKS,
    STACKS,
    TORCH_CUDA_FREED,
    Case,
    Instance,
    Op,
    Pair,
    Program,
    TensorSpec,
    another_thread_alive,
    assert_stack_equal,
    assert_tree_equal,
    build,
    cases,
    draws_random,
    each_device,
    examples,
    func_programs,
    identity,
    programs,
    realize,
    spec_trees,
    unless_torch_cuda_fails,
)

FEW = examples(15)
SOME = examples(30)
MODES = tuple(EAGER_MODES)
# Known failures, replayed on every run. relu_ on a view of an intermediate: the double
# backward unpacks one saved value twice.
RELU_ON_VIEW = Case(
    (TensorSpec((2, 2), 0), None),
    {},
    Program(2, (Op("sin", (0,)), Op("inplace", (1, 1), ("cols", ("mul_s", "relu_"))))),
)
# A region's output used nonlinearly outside it: grad(grad) differs in the last bit.
EXP_UNDER_GRAD_GRAD = Program(2, (Op("exp", (0,)),))
# Plain raises under vmap(grad) (vmap's fallback for addcmul_ leaves a view that relu_
# takes for a leaf): remat must raise the same. Found by `make fuzz`.
RELU_ON_A_VIEW = Program(
    2,
    (
        Op("sin", (0,)),
        Op("sin", (1,)),
        Op("matmul", (2,), "w"),
        Op("inplace", (3, 3), ("whole", ("mul_s",))),
        Op("inplace", (2, 4), ("cols", ("addcmul_", "relu_"))),
    ),
)
NESTINGS = {"remat_in_remat": (remat, remat), "regions_in_plain_fn": (identity, remat)}
pytestmark = each_device


def _check(
    case: Case,
    mode: str,
    device: str,
    outer: Callable[..., Any] = remat,
    inner: Callable[..., Any] = identity,
) -> None:
    with unless_torch_cuda_fails(case.program, device):
        expected = EAGER_MODES[mode](case.make(device=device))
        actual = EAGER_MODES[mode](case.make(outer, inner, device))
    assert_tree_equal(actual, expected)


@pytest.mark.parametrize("mode", MODES)
@SOME
@given(case=cases(block_depth=0))
@example(case=RELU_ON_VIEW)
def test_eager_modes(device: str, mode: str, case: Case) -> None:
    """remat(fn) gives fn's outputs and gradients bitwise under each eager autograd mode."""
    _check(case, mode, device)


@pytest.mark.parametrize("where", ["cpu", "cuda"])
@settings(max_examples=1)
@given(nothing=st.none())  # reject() is for tests that hypothesis runs
def test_only_torchs_own_cuda_failure_is_rejected(device: str, where: str, nothing: None) -> None:
    """The corpora skip an example only for torch's CUDA error on relu_ on a view; the same
    error on the CPU or in another program, or another error, still fails the test."""
    freed = RuntimeError(f"{TORCH_CUDA_FREED} (or directly access saved tensors ...)")
    runs = [
        (RELU_ON_VIEW.program, freed),
        (Program(2, (Op("sin", (0,)),)), freed),
        (RELU_ON_VIEW.program, RuntimeError("another error")),
    ]
    for i, (program, error) in enumerate(runs):
        skipped = where == "cuda" and i == 0
        expected = pytest.raises(UnsatisfiedAssumption if skipped else RuntimeError)
        with expected, unless_torch_cuda_fails(program, where):
            raise error


@pytest.mark.parametrize("mode", ["backward", "grad_subset", "retain_graph", "create_graph"])
@SOME
@given(case=cases(required=("inner_grad",), block_depth=0))
def test_autograd_grad_inside_fn(device: str, mode: str, case: Case) -> None:
    """A fn that calls torch.autograd.grad on its own intermediates is matched by remat(fn)."""
    _check(case, mode, device)


@pytest.mark.parametrize("nesting", NESTINGS)
@pytest.mark.parametrize("mode", MODES)
@FEW
@given(case=cases(required=("block", "block")))
def test_nested_remat(device: str, mode: str, nesting: str, case: Case) -> None:
    """Regions inside regions, or several inside a plain fn, match fn with no region at all."""
    outer, inner = NESTINGS[nesting]
    _check(case, mode, device, outer, inner)


@pytest.mark.parametrize("nesting", NESTINGS)
@FEW
@given(case=cases(required=("block", "inner_grad")), mode=st.sampled_from(MODES))
def test_nested_remat_with_another_thread_alive(
    device: str, mode: str, nesting: str, case: Case
) -> None:
    """Nested regions and an inner autograd.grad, with another thread alive: fn's results."""
    outer, inner = NESTINGS[nesting]
    with another_thread_alive():
        _check(case, mode, device, outer, inner)


def _reused_layer(program: Program, seed: int, wrap: Callable[..., Any], device: str) -> Instance:
    layer, params = build(program, device=device)
    region = wrap(layer)
    x = TensorSpec((program.n, program.n), seed)
    (x,), targets = realize((x,), device)
    return Instance(wrap(lambda x: region(region(x))), (x,), {}, targets + params)


@pytest.mark.parametrize("mode", ["backward", "retain_graph", "create_graph"])
@FEW
@given(
    program=st.integers(2, 4).flatmap(
        lambda n: programs(n, 1, max_ops=4, outputs=("last",), block_depth=0)
    ),
    seed=st.integers(0, 2**16),
)
def test_one_region_called_twice(device: str, mode: str, program: Program, seed: int) -> None:
    """One remat'd layer applied twice, inside a remat'd fn, matches the plain layer twice."""
    expected = EAGER_MODES[mode](_reused_layer(program, seed, identity, device))
    actual = EAGER_MODES[mode](_reused_layer(program, seed, remat, device))
    assert_tree_equal(actual, expected)


def _keywords(inst: Instance) -> Instance:
    x, tree = inst.args
    return dataclasses.replace(inst, args=(), kwargs={"x": x, "tree": tree, **inst.kwargs})


@pytest.mark.parametrize("mode", ["outputs", "backward"])
@FEW
@given(case=cases())
def test_keyword_arguments(device: str, mode: str, case: Case) -> None:
    """Arguments passed only by keyword reach fn, and gradients reach every keyword tensor."""
    expected = EAGER_MODES[mode](_keywords(case.make(device=device)))
    actual = EAGER_MODES[mode](_keywords(case.make(remat, remat, device)))
    assert_tree_equal(actual, expected)


def _tree_fn(tree: Any, *, kw: Any) -> Any:
    def step(leaf: Any) -> Any:
        return leaf.sin().exp() * 2 if isinstance(leaf, torch.Tensor) else leaf

    return optree.tree_map(step, (tree, {"kw": kw}), namespace=NAMESPACE)


def _tree_instance(tree: Any, kw: Any, wrap: Callable[..., Any], device: str) -> Instance:
    (tree, kw), targets = realize((tree, kw), device)
    return Instance(wrap(_tree_fn), (tree,), {"kw": kw}, targets)


@pytest.mark.parametrize("mode", ["outputs", "backward", "create_graph"])
@SOME
@given(tree=spec_trees(), kw=spec_trees())
def test_pytrees_pass_through(device: str, mode: str, tree: Any, kw: Any) -> None:
    """Pytree arguments keep structure and non-tensor objects; every grad leaf gets its grad."""
    expected = EAGER_MODES[mode](_tree_instance(tree, kw, identity, device))
    actual = EAGER_MODES[mode](_tree_instance(tree, kw, remat, device))
    assert_tree_equal(actual, expected)


EMPTIES = {
    "none": None,
    "tuple": (),
    "list": [],
    "dict": {},
    "ordered_dict": collections.OrderedDict(),
    "defaultdict": collections.defaultdict(list),
    "deque": collections.deque(),
    "namedtuple": Pair(None, ()),
    "nested": ((), [None], {"a": {}, "b": collections.deque([[]])}),
}


def _with_empty(x: torch.Tensor, empty: Any, *, also: Any = None) -> Any:
    return x.sin().exp(), empty, {"also": also, "none": None}


@pytest.mark.parametrize("mode", ["outputs", "backward"])
@pytest.mark.parametrize("empty", EMPTIES.values(), ids=EMPTIES.keys())
def test_none_and_empty_containers(device: str, mode: str, empty: Any) -> None:
    """None and empty containers, positional or keyword, come back as they went in."""

    def instance(wrap: Callable[..., Any]) -> Instance:
        (x,), targets = realize((TensorSpec((2, 3), 0),), device)
        return Instance(wrap(_with_empty), (x, empty), {"also": empty}, targets)

    expected = EAGER_MODES[mode](instance(identity))
    actual = EAGER_MODES[mode](instance(remat))
    assert_tree_equal(actual, expected)
    assert actual[0][1] is empty


def _aliased(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sin() * b).exp() @ (a * b.cos()).t()


ALIASES: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "same_tensor_twice": lambda x: (x, x),
    "tensor_and_its_transpose": lambda x: (x, x.t()),
    "tensor_and_a_row": lambda x: (x, x[1]),
    "derived_and_its_base": lambda x: (x * 2, x),
}


@pytest.mark.parametrize("mode", ["backward", "create_graph"])
@pytest.mark.parametrize("alias", ALIASES)
def test_aliased_inputs(device: str, mode: str, alias: str) -> None:
    """Arguments that are the same tensor, or views of one another, match fn."""

    def instance(wrap: Callable[..., Any]) -> Instance:
        (x,), targets = realize((TensorSpec((3, 3), 1),), device)
        return Instance(wrap(_aliased), ALIASES[alias](x), {}, targets)

    assert_tree_equal(EAGER_MODES[mode](instance(remat)), EAGER_MODES[mode](instance(identity)))


def _module_instance(wrap: Callable[..., Any], device: str) -> Instance:
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3, dtype=DTYPE).to(device)
    norm = torch.nn.LayerNorm(3, dtype=DTYPE).to(device)
    (x,), targets = realize((TensorSpec((4, 3), 2, "const"),), device)
    fn = wrap(lambda x: norm(torch.tanh(linear(x)).exp()) * linear.weight.sum())
    return Instance(fn, (x,), {}, [*targets, *linear.parameters(), *norm.parameters()])


@pytest.mark.parametrize("mode", MODES)
def test_closure_parameters(device: str, mode: str) -> None:
    """Gradients reach module parameters that fn reads by closure, never passed as arguments."""
    expected = EAGER_MODES[mode](_module_instance(identity, device))
    assert_tree_equal(EAGER_MODES[mode](_module_instance(remat, device)), expected)


def _func_input(program: Program, seed: int, batched: bool, device: str) -> torch.Tensor:
    shape = (2, program.n, program.n) if batched else (program.n, program.n)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=DTYPE).to(device)


# vmap runs clamp_ and addcmul_ through its (slow but exact) fallback, and says so.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("stack", STACKS)
@SOME
@given(program=func_programs(), seed=st.integers(0, 2**16))
@example(program=EXP_UNDER_GRAD_GRAD, seed=0)
@example(program=RELU_ON_A_VIEW, seed=0)
def test_func_transforms(
    device: str, stack: str, nested: bool, program: Program, seed: int
) -> None:
    """Under every stack of `STACKS` remat(f) gives f's results bitwise; grad(grad) to
    1e-12 of the largest value plain computes."""
    assume(stack not in NO_RANDOM_STACKS or not draws_random(program))  # see NO_RANDOM_STACKS
    x = _func_input(program, seed, stack in BATCHED, device)
    # Under grad(grad) the outer level differentiates through the recompute's graph,
    # which adds the same terms in another order than the forward's: last-bit
    # differences (seen: 4e-16), in proportion to the terms summed: layer norm of a row of
    # zero variance scales them by 1/sqrt(eps) (seen: 1.5e-12 on a result of 0, which make
    # fuzz found). First-order stacks stay bitwise.
    tolerance = 1e-12 if stack == "grad_grad" else 0.0
    assert_stack_equal(stack, program, x, remat, remat if nested else identity, tolerance)

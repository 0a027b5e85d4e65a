"""Equivalence under policies: whatever `remat(fn, policy=...)` keeps, it computes what fn does.

Every entry of `POLICIES` and random custom policies run the program corpus (with random
ops, and the ops that read values out of tensors, cache, update state, or write to their
inputs) in every eager autograd mode and under torch.func's grad and vmap(grad), on each
device of `DEVICES`; the generators' states after each run are compared too.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from remat import RecomputeError, remat
from tests.helpers import (
    ALL_KINDS,
    BATCHED,
    DTYPE,
    EAGER_MODES,
    EFFECT_KINDS,
    FUNC_EFFECT_KINDS,
    FUNC_KINDS,
    KINDS,
    NAMESPACE,
    POLICIES,
    Case,
    Instance,
    Program,
    another_thread_alive,
    assert_stack_equal,
    assert_tree_equal,
    cases,
    custom_policies,
    each_device,
    examples,
    func_programs,
    reads_memory,
    unless_torch_cuda_fails,
    writes_inputs,
)

# Budget: the whole file runs in about 30 s with -n 2 on 2 cores when every example runs.
FEW = examples(10)
MORE = examples(15)  # the eager mode is drawn too
SOME = examples(20)
MODES = tuple(EAGER_MODES)
FUNC_STACKS = tuple(FUNC_EFFECT_KINDS)  # grad, vmap_grad
pytestmark = each_device
# torch.func runs none of inner_grad (autograd.grad), buffer_update (it mutates a captured
# tensor) and inplace_input (its input is a leaf requiring grad: it would write to a clone);
# under vmap, tolist_branch and split_sizes cannot read numbers out of a batched tensor.
# Random ops run under both: vmap_grad draws each example's own numbers (see `STACKS`).
FUNC_PROGRAMS = {
    stack: func_programs(kinds=(*FUNC_KINDS, *FUNC_EFFECT_KINDS[stack]), block_depth=0).filter(
        lambda program: not reads_memory(program)  # no .numpy() of a wrapped tensor
    )
    for stack in FUNC_STACKS
}


def _run(mode: str, inst: Instance) -> Any:
    """The mode's results, then the state tensors the program updated."""
    return EAGER_MODES[mode](inst), inst.state


def _check(case: Case, mode: str, policy: Any, device: str) -> None:
    wrap = functools.partial(remat, policy=policy, namespace=NAMESPACE)
    try:
        with unless_torch_cuda_fails(case.program, device):
            expected = _run(mode, case.make(device=device))
            actual = _run(mode, case.make(wrap, device=device))
    except RecomputeError as error:
        # A write to an argument inside fn: remat may refuse it, naming where it happened.
        if not (writes_inputs(case.program) and "inside" in str(error)):
            raise
        return
    assert_tree_equal(actual, expected)


def _effect_cases(kind: str) -> st.SearchStrategy[Case]:
    """Programs with ``kind`` and no other effect kind, so a failure names its kind."""
    return cases(kinds=(*KINDS, kind), required=(kind,), block_depth=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
@FEW
@given(case=cases(kinds=KINDS, block_depth=0))
def test_policy_matches_plain(device: str, policy: str, mode: str, case: Case) -> None:
    """Under every policy, remat(fn) gives fn's outputs and gradients bitwise in each mode."""
    _check(case, mode, POLICIES[policy], device)


@pytest.mark.parametrize("policy", POLICIES)
@FEW
@given(case=cases(kinds=ALL_KINDS, block_depth=0), mode=st.sampled_from(MODES))
def test_policy_with_another_thread_alive(device: str, policy: str, mode: str, case: Case) -> None:
    """With another thread alive (Jupyter, data loaders), each policy still gives fn's results."""
    with another_thread_alive():
        _check(case, mode, POLICIES[policy], device)


@pytest.mark.parametrize("kind", EFFECT_KINDS)
@pytest.mark.parametrize("policy", POLICIES)
@MORE
@given(data=st.data(), mode=st.sampled_from(MODES))
def test_policy_effects(
    device: str, policy: str, kind: str, mode: str, data: st.DataObject
) -> None:
    """Under every policy, fn's reads, caches, state and input writes give fn's results."""
    _check(data.draw(_effect_cases(kind), label="case"), mode, POLICIES[policy], device)


@pytest.mark.parametrize("mode", MODES)
@SOME
@given(policy=custom_policies(), case=cases(kinds=ALL_KINDS, block_depth=0))
def test_custom_policy(device: str, mode: str, policy: Any, case: Case) -> None:
    """A custom callable saving, offloading or recomputing each op gives fn's results bitwise."""
    _check(case, mode, policy, device)


def _check_func(stack: str, policy: Any, program: Program, seed: int, device: str) -> None:
    shape = (2, program.n, program.n) if stack in BATCHED else (program.n, program.n)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator, dtype=DTYPE).to(device)
    assert_stack_equal(stack, program, x, functools.partial(remat, policy=policy))


# vmap runs clamp_, addcmul_ and bincount through its (slow but exact) fallback, and says so.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("stack", FUNC_STACKS)
@pytest.mark.parametrize("policy", POLICIES)
@FEW
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_policy_under_func(
    device: str, policy: str, stack: str, data: st.DataObject, seed: int
) -> None:
    """Under every policy, grad and vmap(grad) of remat(f) give f's results bitwise."""
    program = data.draw(FUNC_PROGRAMS[stack], label="program")
    _check_func(stack, POLICIES[policy], program, seed, device)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("stack", FUNC_STACKS)
@SOME
@given(policy=custom_policies(), data=st.data(), seed=st.integers(0, 2**16))
def test_custom_policy_under_func(
    device: str, stack: str, policy: Any, data: st.DataObject, seed: int
) -> None:
    """Under grad and vmap(grad), remat(f) with a custom callable policy gives f's results."""
    _check_func(stack, policy, data.draw(FUNC_PROGRAMS[stack], label="program"), seed, device)

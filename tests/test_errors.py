"""`RecomputeError`: a recompute that diverges from its forward is reported, never used."""

import inspect
import os
import re
from typing import Any

import pytest
import torch

from remat import RecomputeError, debug, remat

HERE = os.path.basename(__file__)


def _line_of(fn, text):
    """``file:line`` of the first line of ``fn``'s source containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return f"{HERE}:{start + next(i for i, line in enumerate(lines) if text in line)}"


def _x():
    return torch.linspace(-1, 1, 12).reshape(4, 3).requires_grad_()


def _weights():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, 3, generator=gen), torch.randn(3, 5, generator=gen)


def _width_changes(calls):
    """A 5-op region whose matrix product is 3 wide in the forward and 5 wide after."""

    def fn(x, w3, w5):
        a = x.sin().exp()
        w = w5 if calls else w3
        calls.append(None)
        h = a @ w
        return h.sin().sigmoid()  # sin saves h, the product

    return fn


def test_recompute_error_is_a_runtime_error():
    """`RecomputeError` is a RuntimeError, so generic handlers catch it."""
    assert issubclass(RecomputeError, RuntimeError)


def test_shape_divergence_names_op_position_and_both_shapes():
    """A recomputed value of another shape raises, naming the op, the position, both shapes."""
    y = remat(_width_changes([]))(_x(), *_weights())
    with pytest.raises(RecomputeError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "the recompute diverged from the forward at saved value #1." in message
    assert "Forward: output of aten.mm, float32[4, 3] on cpu" in message
    assert "Recompute: output of aten.mm, float32[4, 5] on cpu" in message
    assert "`check='none'`" in message
    assert "`remat.debug()`" in message
    assert "Op sequences" not in message


def test_dtype_divergence_names_both_dtypes():
    """A recomputed value of another dtype raises, naming both dtypes."""
    calls = []

    def fn(x):
        h = x.sin()
        if calls:
            h = h.double()
        calls.append(None)
        return h.exp()

    y = remat(fn)(_x())
    with pytest.raises(
        RecomputeError,
        match=re.escape(
            "saved value #0. Forward: output of aten.exp, float32[4, 3] on cpu. "
            "Recompute: output of aten.exp, float64[4, 3] on cpu."
        ),
    ):
        y.sum().backward()


def test_added_op_that_changes_shapes_raises():
    """An op added on the recompute that changes later shapes raises at the first of them."""
    calls = []

    def fn(x):
        h = x.sin()
        if calls:
            h = torch.cat([h, h])  # cat saves nothing
        calls.append(None)
        return h.exp().tanh()

    y = remat(fn)(_x())
    with pytest.raises(RecomputeError, match=r"#0\. Forward: .*\[4, 3\].*Recompute: .*\[8, 3\]"):
        y.sum().backward()


def test_fewer_saved_values_raises():
    """A recompute that ends before rebuilding every needed value raises, naming the first."""
    calls = []

    def fn(x):
        h = x.sin().exp()
        if not calls:
            h = h.tanh()
        calls.append(None)
        return h

    y = remat(fn)(_x())
    with pytest.raises(
        RecomputeError,
        match=re.escape(
            "the recompute rebuilt 1 of the 2 values backward needs; "
            "value #1 (output of aten.tanh, float32[4, 3] on cpu) was never rebuilt"
        ),
    ):
        y.sum().backward()


def test_check_none_still_computes_the_plain_gradient():
    """``check='none'`` on a deterministic ``fn`` gives the plain gradient."""
    fn = _width_changes([None])  # always 5 wide
    x = _x()
    (grad,) = torch.autograd.grad(remat(fn, check="none")(x, *_weights()).sum(), x)
    assert torch.equal(grad, torch.autograd.grad(fn(x, *_weights()).sum(), x)[0])


def test_check_none_skips_comparison_and_autograd_rejects_the_shape():
    """``check='none'`` raises no RecomputeError; an incompatible shape fails in autograd."""
    # Observed: torch's own broadcasting error from SinBackward, not a wrong gradient.
    y = remat(_width_changes([]), check="none")(_x(), *_weights())
    with pytest.raises(RuntimeError, match="must match the size of tensor") as info:
        y.sum().backward()
    assert not isinstance(info.value, RecomputeError)


def test_check_none_trusts_fn_where_shapes_catches_a_divergence():
    """A divergence that broadcasts: ``check='shapes'`` raises, ``check='none'`` does not look.

    ``check='none'`` is the documented opt-out for functions known to recompute
    exactly; this pins what it gives up.
    """

    def make():
        calls = []

        def fn(x):
            h = x * 2 if not calls else x[:1] * 2  # [4, 3] in the forward, [1, 3] after
            calls.append(None)
            return h.sin()

        return fn

    x = _x()
    with pytest.raises(RecomputeError, match=r"float32\[4, 3\].*float32\[1, 3\]"):
        remat(make())(x).sum().backward()
    (unchecked,) = torch.autograd.grad(remat(make(), check="none")(x).sum(), x)
    (expected,) = torch.autograd.grad((x * 2).sin().sum(), x)
    assert not torch.equal(unchecked, expected)


def test_debug_shows_op_sequences_with_source_lines():
    """`debug()`: both op sequences to the first divergence, with source lines, < 60 lines."""
    fn = _width_changes([])
    with debug():
        y = remat(fn)(_x(), *_weights())
    with pytest.raises(RecomputeError) as info:
        y.sum().backward()
    message = str(info.value)
    lines = message.splitlines()
    assert len(lines) < 60
    assert "Op sequences (forward | recompute):" in message
    at_exp, at_mm = _line_of(fn, "x.sin().exp()"), _line_of(fn, "a @ w")
    assert f"aten.sin -> float32[4, 3] on cpu  ({at_exp})" in message
    (diverged,) = [line for line in lines if line.startswith("!")]
    assert f"aten.mm -> float32[4, 3] on cpu  ({at_mm})" in diverged
    assert f"aten.mm -> float32[4, 5] on cpu  ({at_mm})" in diverged
    assert "aten.sigmoid" not in message  # nothing after the first divergence


def test_debug_recompute_column_lists_only_fn_ops():
    """The recompute column lists only ops ``fn`` ran, never remat's own (detach, meta)."""
    # The divergence here is in a value mm saves before it runs (a closure weight).
    w3, w5 = _weights()
    calls = []

    def fn(x):
        w = w5 if calls else w3  # read by closure: saved (and recomputed) like an intermediate
        calls.append(None)
        return (x.sin() @ w).exp()

    with debug():
        y = remat(fn)(_x())
    with pytest.raises(RecomputeError) as info:
        y.sum().backward()
    message = str(info.value)
    rows = [line for line in message.splitlines() if re.match(r"[! ] *\d+ ", line)]
    assert "aten.sin -> float32[4, 3] on cpu" in rows[0]
    for row in rows:
        recompute = row.split(" | ", 1)[1]
        assert "aten.empty" not in recompute, row
        assert "on meta" not in recompute, row


def test_debug_message_stays_short_for_long_regions():
    """A divergence after 200 matching ops still gives a short message."""
    calls = []

    def fn(x):
        for _ in range(100):
            x = x.sin().exp()
        if calls:
            x = torch.cat([x, x])
        calls.append(None)
        return x.tanh()

    with debug():
        y = remat(fn)(_x())
    with pytest.raises(RecomputeError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "matching ops" in message
    assert len(message.splitlines()) < 20


def test_debug_needs_the_forward_inside_it():
    """`remat.debug()` around the backward alone adds no op sequences."""
    y = remat(_width_changes([]))(_x(), *_weights())
    with debug(), pytest.raises(RecomputeError) as info:
        y.sum().backward()
    assert "Op sequences" not in str(info.value)


class _WritesArgument(torch.nn.Module):
    def forward(self, x: torch.Tensor, state: list[torch.Tensor], **options: Any) -> torch.Tensor:
        state[0].add_(1)
        return (x * state[0]).sin()


def _writes_argument(x: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
    state[0].add_(1)
    return (x * state[0]).sin()


@pytest.mark.parametrize("fn", ["module", "function with *args"])
def test_an_argument_written_inside_fn_is_named_by_its_parameter(fn):
    """A module's argument was named by ``nn.Module.__call__``'s parameters
    (`` `kwargs[0]` ``, found by a helper); it is named by its ``forward``'s, and one
    gathered by ``*args`` by its position."""
    x = torch.ones(3, requires_grad=True)
    if fn == "module":
        call, name = lambda: remat(_WritesArgument())(x, [torch.zeros(3)]), "`state[0]`"
    else:
        call, name = lambda: remat(_writes_argument)(x, torch.zeros(3)), "`args[1]`"
    with pytest.raises(RecomputeError, match=re.escape(f"argument {name} was modified")):
        call()

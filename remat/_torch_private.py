"""Every private torch API that remat uses, and nothing else.

Each entry says why no public API serves. ``tests/test_torch_private.py`` checks
each one against the installed torch, so an upgrade that changes them fails loudly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._functorch import pyfunctorch

__all__ = [
    "current_graph_task_id",
    "functorch_interpreters",
    "is_dead_wrapper",
    "level_witness",
    "queue_end_of_backward_callback",
    "saved_tensors_hooks_enabled",
]


def current_graph_task_id() -> int:
    """Id of the backward pass running on this thread, or -1 outside backward.

    Recompute happens once per backward pass, so values are keyed by the pass;
    autograd exposes no public notion of "which backward is this".
    """
    return int(torch._C._current_graph_task_id())


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass finishes.

    Lets a pass drop recomputed values it never unpacked (``inputs=`` can leave
    some nodes unexecuted). FSDP and DDP use the same engine hook; it has no
    public spelling.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


@contextlib.contextmanager
def saved_tensors_hooks_enabled() -> Iterator[None]:
    """Re-enable default saved-tensor hooks inside a block, then restore.

    ``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian`` disable them around
    the forward (``disable_saved_tensors_hooks``); there is no public way to
    turn them back on for a region that handles functorch wrappers itself.
    """
    message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    if message is None:
        yield
        return
    torch._C._autograd._saved_tensors_hooks_enable()
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_disable(message)


def functorch_interpreters() -> list[Any]:
    """The active ``torch.func`` transform levels, outermost first.

    The recompute must run at the forward's levels; functorch has no public
    view of its interpreter stack.
    """
    return list(pyfunctorch.retrieve_all_functorch_interpreters())


_PLAIN = torch.empty(())  # made at import, outside any transform, so never wrapped


def level_witness(level: int) -> torch.Tensor:
    """A tiny tensor wrapped at a ``grad``/``jvp`` level, to tell later if it exited.

    Level numbers are positions and get reused; only a wrapper knows whether the
    level it was made at is still alive.
    """
    return torch._C._functorch._wrap_for_grad(_PLAIN, level)


def is_dead_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` wraps a functorch level that has exited."""
    return bool(torch._C._functorch.is_dead_tensor_wrapper(t))  # type: ignore[attr-defined]

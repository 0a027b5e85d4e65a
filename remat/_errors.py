"""Recompute errors, and `debug()` for op-sequence diffs."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

__all__ = [
    "RecomputeError",
    "TraceEntry",
    "debug",
    "debugging",
    "describe",
    "describe_meta",
    "node_op",
    "diff_traces",
    "source_line",
]

_local = threading.local()
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
_CONTEXT = 6  # matching ops shown before the first divergence


class RecomputeError(RuntimeError):
    """The recompute of a remat region diverged from its forward.

    Raised during backward when a recomputed value differs in shape, dtype or
    device from the one the forward saved, or when the recompute saves fewer
    values. Typical causes: ``fn`` branches on global state, reads a tensor
    that was modified in place, or is non-deterministic outside torch's RNG.
    """


@contextlib.contextmanager
def debug() -> Iterator[None]:
    """Make `RecomputeError` show the forward and recompute op sequences.

    Regions whose forward runs inside this context record each aten op with
    the user source line that called it; a divergence then prints both
    sequences side by side up to the first difference.

    Examples:
        >>> import torch
        >>> from remat import remat, debug
        >>> with debug():
        ...     y = remat(torch.sin)(torch.ones(2, requires_grad=True))
        >>> y.sum().backward()
    """
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def debugging() -> bool:
    return getattr(_local, "depth", 0) > 0


def source_line() -> str:
    """``file:line`` of the innermost user frame (outside torch and remat)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP_DIRS) and not path.startswith("<frozen"):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def changed_since_forward(what: str, before: int, after: int, fix: str) -> RuntimeError:
    """The one error for state that changed between the forward and its recompute."""
    return RuntimeError(
        f"`remat`: {what} was modified in place between the forward and the backward "
        f"(version {before} -> {after}); the recompute would read the new value and its "
        f"gradients would be wrong. {fix}"
    )


def data_replaced(what: str, fix: str) -> RuntimeError:
    """`changed_since_forward`, for a tensor given other memory (``.data`` assigned), which
    no version counter shows."""
    return RuntimeError(
        f"`remat`: {what} had its `.data` replaced since the forward began; the recompute "
        "would read the new value (plain autograd's saved tensors hold the old one) and its "
        f"gradients would be wrong. {fix}"
    )


def scripted(what: str) -> TypeError:
    """``what`` is TorchScript (torch.jit.script or trace), which remat cannot follow."""
    return TypeError(
        f"`remat` {what} (torch.jit.script or trace), whose code runs outside Python, "
        "where remat cannot follow its state. Apply `remat` to the eager module or "
        "function, before scripting it, or use `torch.compile`, under which remat works."
    )


def compiled(what: str) -> TypeError:
    """``what`` is ``torch.compile``'s, which remat cannot run inside a region."""
    return TypeError(
        f"`remat` {what} (torch.compile): inside a region, torch runs compiled code eagerly "
        "while remat's dispatch mode is active, and compiles it again under its function "
        "modes, so the recompute cannot reproduce what the forward ran, nor remat's forward "
        "what plain's does. Compile around remat instead: `torch.compile(remat(fn))` traces "
        "the region into the graph (or `remat.apply` the model, then compile it)."
    )


def node_op(node: Any) -> str:
    """The aten op behind an autograd node (or its name): ``AddmmBackward0`` -> ``aten.addmm``."""
    name = (node if isinstance(node, str) else node.name()).rstrip("0123456789")
    name = name.removesuffix("Backward")
    return "aten." + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def describe_meta(shape: Any, dtype: torch.dtype, device: torch.device) -> str:
    """Short tensor metadata for messages: ``float64[4, 8] on cpu``."""
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}"


def describe(value: Any) -> str:
    """`describe_meta` of a tensor, or the type name of anything else."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    return describe_meta(value.shape, value.dtype, value.device)


class TraceEntry(NamedTuple):
    op: str
    out: str
    source: str

    def __str__(self) -> str:
        return f"{self.op} -> {self.out}  ({self.source})"


def diff_traces(forward: list[TraceEntry], recompute: list[TraceEntry]) -> str:
    """Forward and recompute op sequences side by side, up to the first divergence."""
    first = next(
        (i for i, (a, b) in enumerate(zip(forward, recompute, strict=False)) if a[:2] != b[:2]),
        min(len(forward), len(recompute)),
    )
    start = max(0, first - _CONTEXT)
    left = [str(e) for e in forward[start : first + 1]]
    right = [str(e) for e in recompute[start : first + 1]]
    width = max([len("forward"), *map(len, left)])
    lines = [f"   # {'forward':<{width}} | recompute"]
    if start:
        lines.append(f"   ... {start} matching ops")
    for i in range(max(len(left), len(right))):
        a = left[i] if i < len(left) else "(ended)"
        b = right[i] if i < len(right) else "(ended)"
        mark = "!" if i + start == first else " "
        lines.append(f"{mark}{i + start:>3} {a:<{width}} | {b}")
    return "\n".join(lines)

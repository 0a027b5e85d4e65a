"""Introspection: what a function keeps for backward, and where it came from."""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable
from typing import Any, Literal

import optree
import torch

from . import _torch_private
from ._errors import describe_meta, source_line

__all__ = ["Collector", "Residual", "current", "print_saved_residuals", "saved_residuals"]

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor held for backward after a forward.

    Attributes:
        shape: its shape.
        dtype: its dtype.
        device: where it lives while held (the offload device for ``"offloaded"``).
        nbytes: bytes of its storage (shared storages are listed once).
        kind: ``"input"`` (a reference to an argument), ``"saved"`` or ``"offloaded"``.
        op: the aten op (an ``OpOverload``) that produced it, or None.
        name: its `remat.name` tag, or None.
        source: a short origin, such as ``output of aten.mm at model.py:42``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    kind: Literal["input", "saved", "offloaded"]
    op: Any
    name: str | None
    source: str


class Collector(_torch_private.TorchDispatchMode):
    """What `saved_residuals` gathers: records, and who produced each tensor."""

    def __init__(self, arguments: list[torch.Tensor]) -> None:
        super().__init__()
        self.records: list[tuple[Any, Residual]] = []
        self.arguments = {id(t): t for t in arguments}
        self.producers: dict[int, tuple[Any, str]] = {}  # id(output) -> (aten op, line)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self.producers[id(t)] = (func, source_line())
        return out

    def add(self, t: torch.Tensor, kind: Any, op: Any, name: str | None, source: str) -> None:
        """Record ``t``, keyed by the storage it holds (listed once however many views)."""
        if _has_storage(t):
            key: Any = t.untyped_storage().data_ptr()
            nbytes = t.untyped_storage().nbytes()
        else:
            key, nbytes = id(t), t.nbytes
        residual = Residual(tuple(t.shape), t.dtype, t.device, nbytes, kind, op, name, source)
        self.records.append((key, residual))

    def add_saved(self, t: torch.Tensor, path: str | None = None) -> None:
        """A tensor held as it is: an argument of ``fn``, or a value made inside it."""
        if self.arguments.get(id(t)) is t:
            self.add(t, "input", None, None, f"argument {path}" if path else "an argument")
            return
        op, line = self.producers.get(id(_torch_private.unwrap_all(t)), (None, None))
        where = f"output of {op.overloadpacket} at {line}" if op else "a tensor made outside `fn`"
        if path:
            where += f", argument {path} of a remat region"
        self.add(t, "saved", op, None, where)


def current() -> Collector | None:
    """The collector of the running `saved_residuals`, if any."""
    return getattr(_local, "collector", None)


def _has_storage(t: torch.Tensor) -> bool:
    return _torch_private.wrapper_level(t) == -1


def saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """Run ``fn`` once and list the tensors held for its backward.

    Works on remat'd functions, on functions that contain remat regions, and on
    plain functions (where it lists what plain autograd keeps).

    Args:
        fn: the function to run.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        A `Residual` per held tensor storage, inputs first.

    Examples:
        >>> import torch, remat
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> [r.kind for r in remat.saved_residuals(remat.remat(torch.sin), x)]
        ['input']
    """
    tree: Any = (args, kwargs)
    leaves: list[Any] = optree.tree_leaves(tree)
    found = Collector([t for t in leaves if isinstance(t, torch.Tensor)])
    hooks = torch.autograd.graph.saved_tensors_hooks(_pack_into(found), lambda t: t)
    previous = current()
    _local.collector = found
    try:
        with found, torch.enable_grad(), hooks:
            fn(*args, **kwargs)
    finally:
        _local.collector = previous
    return _dedupe(found.records)


def _pack_into(found: Collector) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        found.add_saved(t)
        return t

    return pack


def _dedupe(records: list[tuple[Any, Residual]]) -> list[Residual]:
    order = {"input": 0, "saved": 1, "offloaded": 2}
    seen: dict[Any, Residual] = {}
    for key, record in sorted(records, key=lambda kr: order[kr[1].kind]):
        seen.setdefault(key, record)
    return list(seen.values())


def print_saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Print `saved_residuals` as a table, with the total bytes held.

    Examples:
        >>> import torch, remat
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> remat.print_saved_residuals(remat.remat(torch.sin), x)  # doctest: +NORMALIZE_WHITESPACE
        kind   bytes  tensor                 name  source
        input  256    float32[8, 8] on cpu   -     argument `args[0]`
        total: 256 bytes (0 bytes besides inputs)
    """
    rows = [
        (r.kind, str(r.nbytes), describe_meta(r.shape, r.dtype, r.device), r.name or "-", r.source)
        for r in saved_residuals(fn, *args, **kwargs)
    ]
    header = ("kind", "bytes", "tensor", "name", "source")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[4]
        )
    total = sum(int(row[1]) for row in rows)
    held = sum(int(row[1]) for row in rows if row[0] != "input")
    print(f"total: {total} bytes ({held} bytes besides inputs)")


def input_paths(
    fn: Callable[..., Any], call: Any, kinds: tuple[type, ...], namespace: str = ""
) -> list[str]:
    """Readable paths (like `` `x['a'][0]` ``) of the leaves of ``call`` of the given types,
    by the names of ``fn``'s positional parameters (a module's ``forward``'s)."""
    names = []
    try:
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        for parameter in inspect.signature(target).parameters.values():
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                break  # (``*args``: by position)
            names.append(parameter.name)
    except (TypeError, ValueError):
        pass
    paths, leaves, _ = optree.tree_flatten_with_path(call, none_is_leaf=True, namespace=namespace)
    out = []
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, kinds):
            continue
        where, first, *rest = path
        if where == 1:
            head = str(first)
        elif first < len(names) and names[first] != "self":
            head = names[first]
        else:
            head = f"args[{first}]"
        out.append(f"`{head}{''.join(f'[{k!r}]' for k in rest)}`")
    return out

"""Module state a region reads by closure, pinned for its recompute.

``torch.func.functional_call`` swaps a module's parameters and buffers only for
the duration of the call, but the recompute runs later, during backward. A
region therefore records the tensors of the modules it can see (``self`` of a
method, module arguments, a bound method's owner, modules in ``fn``'s closure)
at forward time, and puts them back for the recompute if they changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleState"]


class ModuleState:
    """The parameter and buffer tensors of some modules, by slot, with versions."""

    __slots__ = ("generators", "slots")

    def __init__(
        self, slots: list[tuple[dict[str, Any], str, torch.Tensor, int]], generators: list[Any]
    ) -> None:
        self.slots = slots
        self.generators = generators  # explicit torch.Generators kept as module attributes

    @classmethod
    def capture(cls, fn: Callable[..., Any], leaves: list[Any]) -> ModuleState | None:
        modules = [leaf for leaf in [fn, *leaves] if isinstance(leaf, nn.Module)]
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, nn.Module):
            modules.append(owner)
        for cell in getattr(fn, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if isinstance(cell.cell_contents, nn.Module):
                    modules.append(cell.cell_contents)
        if not modules:
            return None
        slots: list[tuple[dict[str, Any], str, torch.Tensor, int]] = []
        generators: list[Any] = []
        seen: set[int] = set()
        for module in modules:
            for sub in module.modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                generators.extend(v for v in vars(sub).values() if isinstance(v, torch.Generator))
                for table in (sub._parameters, sub._buffers):
                    slots.extend(
                        (table, name, t, t._version) for name, t in table.items() if t is not None
                    )
        return cls(slots, generators)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Within the block, every slot holds the tensor it held at forward time."""
        for _, name, t, version in self.slots:
            if t._version != version:
                raise RuntimeError(
                    f"`remat`: module tensor `{name}` was modified in place between the forward "
                    f"and the backward (version {version} -> {t._version}), so the recompute "
                    "would give wrong gradients. Step the optimizer after the backward."
                )
        changed = [(table, name, t) for table, name, t, _ in self.slots if table.get(name) is not t]
        previous: list[tuple[dict[str, Any], str, Any]] = [
            (table, name, table.get(name)) for table, name, _ in changed
        ]
        for table, name, t in changed:
            table[name] = t
        try:
            yield
        finally:
            for table, name, t in previous:
                table[name] = t

"""Module state a region reads by reference, as its recompute must see it.

A region finds the modules ``fn`` can reach (`reachable`: ``fn`` itself, ``self`` of
a bound method, partials, closures, defaults, named globals, module arguments, and the
containers holding them, at any depth) and records, for each parameter and buffer
slot, the tensor it held at entry.

- ``torch.func.functional_call`` swaps tensors into the slots only for the call,
  but the recompute runs later: the recompute puts the forward's tensor back.
- A tensor the forward updates in place (BatchNorm's running statistics, an EMA,
  spectral norm's power-iteration vectors) is snapshotted at entry (an update is
  told by its version counter, or by its value: batch norm's kernel writes its
  statistics without a version bump); the
  recompute runs on a private copy of the snapshot, so it reads what the forward
  read, and the live buffer keeps the forward's update (applied once).
  Every buffer of a module is snapshotted the first time a region sees it in
  training (and in eval) mode; after that, only those a forward has updated.
- A region input that does not require grad is treated the same way: kernels
  that write without a version bump (``F.batch_norm`` with running statistics
  passed as arguments) update it once, and the recompute reads a private copy.
  Every such input is snapshotted the first time a region runs a module (or a
  function's code); after that, only those positions a forward updated.
- A slot whose tensor the forward itself replaced (a module assigning a new
  buffer) is left alone, and so is every parameter slot of a module inside an
  FSDP2 unit: FSDP2 swaps sharded and unsharded parameters in and out of it
  between the forward and the backward, and installs for the recompute what it
  re-gathers from the shards (as for plain autograd). Their buffers are handled
  like any other module's. A sharded parameter the region saw is version-checked:
  updating it before the backward raises, as for any other parameter.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _torch_private
from ._errors import RecomputeError, changed_since_forward

__all__ = ["ModuleState", "Reached", "reachable"]

# Per module (or what learns about a region's inputs, see `_owner`) and training flag:
# names of its tensors some region's forward updated in place. By flag, as batch
# norm updates its statistics in training only.
_UPDATED: weakref.WeakKeyDictionary[Any, dict[bool | None, set[str]]] = weakref.WeakKeyDictionary()


def _learned(owner: Any) -> set[str] | None:
    """What forwards of ``owner`` in its current training mode were seen to update."""
    return _UPDATED.get(owner, {}).get(getattr(owner, "training", None))


def _learning(owner: Any) -> set[str]:
    """The same set, made if needed, for a forward to add to."""
    return _UPDATED.setdefault(owner, {}).setdefault(getattr(owner, "training", None), set())


def _fsdp_types() -> tuple[type | None, type | None]:
    """FSDP2's module class and the DTensor class of its sharded parameters, if imported.

    Not imported here (that costs most of a second): a program that has FSDP2 units
    imported `torch.distributed.fsdp` to make them.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    tensor = sys.modules.get("torch.distributed.tensor")
    return getattr(fsdp, "FSDPModule", None), getattr(tensor, "DTensor", None)


class Reached(NamedTuple):
    modules: list[nn.Module]
    generators: list[torch.Generator]


def reachable(fn: Callable[..., Any], leaves: list[Any]) -> Reached:
    """The modules and explicit generators ``fn`` can reach, at any depth.

    From ``fn`` and the argument leaves, through bound ``self``, partials, closure cells,
    defaults, the globals a function's code names, the functions these lead to, and the
    lists, tuples, dicts and sets holding any of them (as ``checkpoint_sequential`` and
    timm's ``checkpoint_seq`` pass modules). A module's submodules are its own business
    (``modules()``); other objects' attributes are searched only for the object a method is
    bound to or that is called.
    """
    reached = Reached([], [])
    seen: set[int] = set()
    stack: list[Any] = [fn, *leaves]
    while stack:
        obj = stack.pop()
        kind = type(obj)
        if kind in _ATOMS or id(obj) in seen:
            continue
        seen.add(id(obj))
        if kind is torch.Generator:  # isinstance goes through a slow metaclass
            reached.generators.append(obj)
        elif isinstance(obj, nn.Module):
            reached.modules.append(obj)
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif callable(obj) and not isinstance(obj, (type, torch.Tensor)):
            stack.extend(_callable_parts(obj))
    return reached


# Leaves that hold nothing to find: skipped first (most arguments are these).
_ATOMS = frozenset({torch.Tensor, nn.Parameter, int, float, bool, str, bytes, type(None)})


def _callable_parts(fn: Any) -> list[Any]:
    """What a callable reaches: a method's function and object, a function's closure,
    defaults and named globals, a callable object's attributes."""
    if isinstance(fn, types.MethodType):
        return [fn.__func__, fn.__self__, *_attributes(fn.__self__)]
    if not isinstance(fn, types.FunctionType):
        return _attributes(fn)
    parts: list[Any] = [getattr(fn, "__wrapped__", None), fn.__defaults__, fn.__kwdefaults__]
    for cell in fn.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            parts.append(cell.cell_contents)
    scope = fn.__globals__
    parts.extend(scope[name] for name in fn.__code__.co_names if name in scope)
    return [p for p in parts if not isinstance(p, (type, types.ModuleType))]


def _attributes(obj: Any) -> list[Any]:
    attributes = None if isinstance(obj, nn.Module) else getattr(obj, "__dict__", None)
    return [attributes] if isinstance(attributes, dict) else []


def _owner(fn: Callable[..., Any]) -> Any:
    """What learns which inputs a region's forward updates: the module it runs, else its code.

    Not the `remat` wrapper: ``remat(layer)(x)`` makes a new one at every call.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    bound = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(bound, nn.Module):
        return bound
    return getattr(getattr(fn, "__func__", fn), "__code__", type(fn))


class _Slot(NamedTuple):
    module: Any  # an nn.Module, or what learns about a region's inputs (see `_owner`)
    table: dict[str, Any] | None  # None for an input
    name: str
    tensor: torch.Tensor
    version: int


def _submodules(modules: list[nn.Module]) -> list[nn.Module]:
    """Every module under ``modules`` (themselves included), each once."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    for module in modules:
        for sub in module.modules():
            if id(sub) not in seen:
                seen.add(id(sub))
                found.append(sub)
    return found


def _sharded_units(submodules: list[nn.Module], fsdp: type | None) -> set[int]:
    """Ids of the modules inside FSDP2 units (the units included): FSDP2 owns their parameters."""
    owned: set[int] = set()
    if fsdp is not None:
        for sub in submodules:
            if id(sub) not in owned and isinstance(sub, fsdp):
                owned.update(id(m) for m in sub.modules())
    return owned


class ModuleState:
    """The parameter and buffer slots of some modules, as the region's forward saw them."""

    __slots__ = ("ended", "generators", "lost", "sharded", "slots", "snapshots")

    def __init__(
        self,
        slots: list[_Slot],
        snapshots: dict[int, torch.Tensor],
        gens: list[Any],
        sharded: list[_Slot],
    ):
        self.slots = slots
        self.snapshots = snapshots  # slot index -> value at entry
        self.generators = gens  # explicit torch.Generators kept as module attributes
        self.sharded = sharded  # FSDP2's sharded parameters, for their versions only
        self.ended: list[int] = []  # slot index -> version when the forward ended
        self.lost: list[_Slot] = []  # updated by the forward, with no snapshot

    @classmethod
    def capture(
        cls, fn: Callable[..., Any], modules: list[nn.Module], inputs: list[torch.Tensor]
    ) -> ModuleState | None:
        slots: list[_Slot] = []
        snapshots: dict[int, torch.Tensor] = {}
        owner = _owner(fn)
        learned = _learned(owner)
        for i, x in enumerate(inputs):
            name = f"input {i}"
            if x.requires_grad or (learned is not None and name not in learned):
                continue
            if _torch_private.unwrap_all(x) is x:  # not under torch.func
                snapshots[len(slots)] = x.detach().clone()
                slots.append(_Slot(owner, None, name, x, x._version))
        if not modules and not slots:
            return None
        generators: list[Any] = []
        sharded: list[_Slot] = []
        submodules = _submodules(modules)
        fsdp, dtensor = _fsdp_types()
        owned = _sharded_units(submodules, fsdp)
        for sub in submodules:
            # Not isinstance: torch.Generator's metaclass makes it slow, on every attribute.
            generators.extend(v for v in vars(sub).values() if type(v) is torch.Generator)
            updated = _learned(sub)
            for table in (sub._parameters, sub._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    if table is sub._parameters and id(sub) in owned:
                        if dtensor is not None and isinstance(t, dtensor):
                            sharded.append(_Slot(sub, table, name, t, t._version))
                        continue
                    first = updated is None and table is sub._buffers
                    if first or (updated is not None and name in updated):
                        with torch.no_grad():
                            snapshots[len(slots)] = t.detach().clone()
                    slots.append(_Slot(sub, table, name, t, t._version))
        return cls(slots, snapshots, generators, sharded)

    def settle(self) -> None:
        """End of the forward: keep snapshots of what it updated, learn what it updates."""
        self.ended = [slot.tensor._version for slot in self.slots]
        for i, slot in enumerate(self.slots):
            updated = _learning(slot.module)
            snapshot = self.snapshots.get(i)
            # Some kernels (batch norm's running statistics) write without a version bump.
            same = self.ended[i] == slot.version and (
                snapshot is None or torch.equal(snapshot, slot.tensor)
            )
            replaced = slot.table is not None and slot.table.get(slot.name) is not slot.tensor
            if same or replaced:
                self.snapshots.pop(i, None)
                continue
            updated.add(slot.name)
            if i not in self.snapshots:
                self.lost.append(slot)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, int]]]:
        """Within the block, every slot shows what the forward read from it.

        Yields the private copies, (copy, the forward's tensor, its version then): it
        puts those of module slots in; the region passes those of its inputs.
        """
        for slot in self.lost:
            raise RecomputeError(
                f"`remat`: the forward updated module tensor `{slot.name}` of "
                f"{type(slot.module).__name__} in place, and remat had not kept its value from "
                "before the forward, so the recompute cannot read what the forward read. This "
                "happens the first time a region's forward updates a parameter (buffers are "
                "always kept the first time); later calls keep it. Update it outside `fn`, "
                "or run one step before training."
            )
        for slot in self.sharded:
            if slot.tensor._version != slot.version:
                raise changed_since_forward(
                    f"FSDP2's sharded parameter `{slot.name}` of {type(slot.module).__name__}",
                    slot.version,
                    slot.tensor._version,
                    "Step the optimizer after the backward.",
                )
        swaps: list[tuple[dict[str, Any], str, Any]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for i, slot in enumerate(self.slots):
            snapshot = self.snapshots.get(i)
            if snapshot is not None:
                with torch.no_grad():
                    copy = snapshot.clone()
                if slot.table is not None:
                    swaps.append((slot.table, slot.name, copy))
                copies.append((copy, slot.tensor, slot.version))
                continue
            if slot.table is None:  # an input: the region checks its version itself
                continue
            current = slot.table.get(slot.name)
            if self.ended and self.ended[i] == slot.version and current is not slot.tensor:
                swaps.append((slot.table, slot.name, slot.tensor))
            if slot.tensor._version != (self.ended[i] if self.ended else slot.version):
                raise changed_since_forward(
                    f"module tensor `{slot.name}` of {type(slot.module).__name__}",
                    slot.version,
                    slot.tensor._version,
                    "Step the optimizer after the backward.",
                )
        previous = [(table, name, table.get(name)) for table, name, _ in swaps]
        for table, name, t in swaps:
            table[name] = t
        try:
            yield copies
        finally:
            for table, name, t in previous:
                table[name] = t

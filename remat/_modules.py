"""Module state a region reads by reference, as its recompute must see it.

A region finds the modules ``fn`` can reach (`reachable`: ``fn`` itself, ``self`` of
a bound method, partials, closures, defaults, named globals, module arguments, and the
containers holding them, at any depth) and records, for each parameter, buffer and
plain tensor attribute slot, the tensor it held at entry.

- ``torch.func.functional_call`` swaps tensors into the slots only for the call,
  but the recompute runs later: the recompute puts the forward's tensor back.
- A tensor the forward updates (BatchNorm's running statistics, an EMA, spectral
  norm's vectors, ``nn.Embedding``'s renormalized rows, a ``.data`` assignment) must be
  read by the recompute as the forward read it, and updated once. The first forward of
  a module (or of a region's owner, for its inputs) in a training mode is *watched*:
  under remat's dispatch mode, a slot is copied just before an op first writes its
  memory, and a ``.data`` assignment is told by the slot's memory moving. Later forwards
  snapshot at entry what a watched forward updated. The recompute runs on a private copy
  of the snapshot; the live tensor keeps the forward's update. A plain buffer or parameter
  is rewound in place instead (`_rewound`), so that every path to it reads what the
  forward read.
- A region input that does not require grad is treated the same way (``F.batch_norm``
  with running statistics passed as arguments writes them without a version bump).
- Plain tensors ``fn`` reaches by reference are version-checked (`loose`): updated by
  the forward, or between the forward and the backward, they raise. Rebound where
  ``fn`` finds them (`Reached.places`), the recompute gets the forward's back.
- Python state the forward changes and reads back: each submodule's own attributes
  (rebound, added or deleted: `_rebound`), the lists, dicts and deques among them and
  within those (`_contents`), and what closure cells and named globals hold
  (`_names_read`: an int, a flag, a function) show the recompute what they held at the
  forward's entry, and what the recompute writes there is undone.
- The recompute of a watched forward refuses writes to memory from before it other
  than the private copies (`WriteGuard`): state held where remat does not look.
- A slot whose tensor the forward itself replaced (a module assigning a new
  buffer) is left alone, unless the forward updated the old tensor in place first (it
  is then an updated slot: the recompute gets a copy of the snapshot in the slot), and
  so is every parameter slot of a module inside an FSDP2 unit: FSDP2 swaps sharded and
  unsharded parameters in and out of it between the forward and the backward, and
  installs for the recompute what it re-gathers from the shards (as for plain
  autograd). Their buffers are handled like any other module's. A sharded parameter
  the region saw is version-checked: updating it before the backward raises, as for
  any other parameter.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import operator
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _torch_private
from ._errors import (
    RecomputeError,
    changed_since_forward,
    compiled,
    data_replaced,
    describe,
    describe_meta,
    scripted,
    source_line,
)

__all__ = [
    "BATCH_NORM_FUNCTIONS",
    "BATCH_NORM_OPS",
    "ModuleState",
    "Reached",
    "SecondUpdates",
    "WriteGuard",
    "owner_of",
    "programs",
    "reachable",
    "same_storage",
    "storage_id",
    "storage_of",
]


class _Learned:
    """What the watched forwards of one module (or owner, see `owner_of`) showed, in one
    training mode (batch norm updates its statistics in training only)."""

    __slots__ = ("programs", "seen", "updated")

    def __init__(self) -> None:
        self.updated: set[str] = set()  # names of its tensors a forward updated in place
        # For an owner: the calls it watched, each by its arguments' tree structure (inputs
        # are learned by leaf position), the type of each leaf (a bool's value), and the
        # objects it reached that remat does not look into (`Reached.opaque`, by identity).
        self.seen: set[tuple[Any, tuple[Any, ...], tuple[int, ...]]] = set()
        # For an owner: the ops its forwards ran, per policy and input layouts (`_keep`).
        self.programs: dict[Any, Any] = {}

    def learn(self, names: set[str], name: str) -> None:
        """Add ``name`` to ``names`` (`updated`): a change the slot plans see."""
        global _GENERATION
        if name not in names:
            with _MAKING:
                names.add(name)
                _GENERATION += 1


# Counts the changes to what any module's record says (a record made, a name learned), under
# `_MAKING`: a `_Plan` made at another count is out of date.
_GENERATION = 0


def programs(owner: Any) -> dict[Any, Any]:
    """The programs of ``owner``'s forwards in its current training mode (made if needed)."""
    return _learning(owner).programs


# Per module (or owner), by id: a weak reference to it, and its records by training flag.
# (Not a WeakKeyDictionary: it is read per module at every region call.)
_LEARNED: dict[int, tuple[weakref.ref[Any], dict[bool | None, _Learned]]] = {}
_MAKING = threading.Lock()


def _learned(owner: Any) -> _Learned | None:
    """What forwards of ``owner`` in its current training mode were seen to do, if any."""
    entry = _LEARNED.get(id(owner))
    if entry is None or entry[0]() is not owner:
        return None
    return entry[1].get(getattr(owner, "training", None))


def _learning(owner: Any) -> _Learned:
    """The same record, made if needed, for a forward to add to."""
    key = id(owner)
    global _GENERATION
    entry = _LEARNED.get(key)
    training = getattr(owner, "training", None)
    record = entry[1].get(training) if entry is not None and entry[0]() is owner else None
    if record is None:
        with _MAKING:  # one record per owner: threads' first calls add to the same one
            entry = _LEARNED.get(key)
            if entry is None or entry[0]() is not owner:
                ref = weakref.ref(owner, lambda _: _LEARNED.pop(key, None))
                entry = _LEARNED[key] = (ref, {})
            record = entry[1].get(training)
            if record is None:
                record = entry[1][training] = _Learned()
                _GENERATION += 1
    return record


def _fsdp_types() -> tuple[type | None, type[torch.Tensor] | None]:
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
    tensors: list[torch.Tensor]  # reached by reference: not the arguments
    opaque: list[int]  # ids of the other objects reached, whose attributes are not searched
    # Where ``fn`` finds `tensors`: each rebindable place on the way (a closure cell, a
    # dict's entry, a list's item) and what it held, (holder, key, object).
    places: list[tuple[Any, Any, Any]]


def reachable(fn: Callable[..., Any], leaves: list[Any]) -> Reached:
    """The modules and explicit generators ``fn`` can reach, at any depth.

    From ``fn`` and the argument leaves, through bound ``self``, partials, closure cells,
    defaults, the globals a function's code names, the functions these lead to, and the
    lists, tuples, dicts and sets holding any of them (as ``checkpoint_sequential`` and
    timm's ``checkpoint_seq`` pass modules). A module's submodules are its own business
    (``modules()``); other objects' attributes are searched only for the object a method is
    bound to or that is called.
    """
    reached = Reached([], [], [], [], [])
    seen: set[int] = set()
    stack: list[Any] = [fn, *(leaf for leaf in leaves if not isinstance(leaf, torch.Tensor))]
    while stack:
        obj = stack.pop()
        kind = type(obj)
        if kind in _ATOMS or id(obj) in seen:
            continue
        seen.add(id(obj))
        if kind is torch.Tensor or kind is nn.Parameter:
            reached.tensors.append(obj)
        elif kind is torch.Generator:  # isinstance goes through a slow metaclass
            reached.generators.append(obj)
        elif isinstance(obj, nn.Module):
            reached.modules.append(obj)
            stack.append(type(obj).forward)  # the code it runs (as for a bound method)
        elif isinstance(obj, _SEQUENCES):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif callable(obj) and not isinstance(obj, (type, torch.Tensor)):
            stack.extend(_callable_parts(obj))
            if kind is types.FunctionType:
                if _torch_private.compiled(obj):
                    raise compiled(f"reached a compiled function `{obj.__qualname__}`")
                reached.places.extend(_names_read(obj))
        else:
            reached.opaque.append(id(obj))
    if reached.tensors:  # (rare: most state is in modules)
        roots = [fn, *(leaf for leaf in leaves if not isinstance(leaf, torch.Tensor))]
        reached.places.extend(_places(roots, set(map(id, reached.tensors))))
    return reached


def _names_read(fn: types.FunctionType) -> list[tuple[Any, Any, Any]]:
    """The closure cells and named globals of ``fn``, as places (`_places`), but those
    holding modules: a counter ``fn`` steps (``nonlocal calls``), a cache it first sets
    from None, a function or a ``partial`` rebound between the forward and the backward."""
    places: list[tuple[Any, Any, Any]] = []
    for cell in fn.__closure__ or ():
        value = _get(cell, None)
        if type(value) is not types.ModuleType:
            places.append((cell, None, value))
    scope = fn.__globals__
    for name in fn.__code__.co_names:
        value = scope.get(name, _ABSENT)
        if value is not _ABSENT and type(value) is not types.ModuleType:
            places.append((scope, name, value))
    return places


def _places(roots: list[Any], wanted: set[int]) -> list[tuple[Any, Any, Any]]:
    """The rebindable places on every path `reachable` takes from ``roots`` to the objects
    ``wanted`` (ids): what the recompute puts back where ``fn``'s code rebinds them
    between the forward and the backward (``t = t + 1`` on a closure variable).

    A place is (holder, key, what it held): a closure cell's contents (key None), a dict's
    entry, or a list's or deque's whole contents (key `_CONTENTS`, a tuple of them; a
    dict's, a copy, for `_contents`).
    """
    nodes: list[tuple[Any, Any, Any, int]] = []  # (holder, key, object, parent node)
    places: dict[tuple[int, Any], tuple[Any, Any, Any]] = {}
    leads: set[int] = set()  # objects on a path to a wanted one

    def record(node: tuple[Any, Any, Any, int]) -> None:
        first = True
        while True:
            holder, key, obj, parent = node
            if not first and id(obj) in leads:
                return  # (the rest of its path is recorded)
            first = False
            leads.add(id(obj))
            if holder is not None:
                places[id(holder), key] = (holder, key, obj)
            if isinstance(obj, (list, collections.deque)):
                places[id(obj), _CONTENTS] = (obj, _CONTENTS, tuple(obj))
            if parent < 0:
                return
            node = nodes[parent]

    seen: set[int] = set()
    stack: list[tuple[Any, Any, Any, int]] = [(None, None, root, -1) for root in roots]
    while stack:
        node = stack.pop()
        obj = node[2]
        if type(obj) in _ATOMS:
            continue
        if id(obj) in wanted:  # (by every path)
            record(node)
            continue
        if id(obj) in seen:  # another path to it (its own were walked already)
            if id(obj) in leads:
                record(node)
            continue
        seen.add(id(obj))
        if isinstance(obj, _SEQUENCES) and not wanted.isdisjoint(map(id, obj)):
            record(node)  # (its wanted items: one place, found natively)
        nodes.append(node)
        here = len(nodes) - 1
        stack.extend((h, k, part, here) for h, k, part in _keyed_parts(obj))
    return list(places.values())


_CONTENTS = object()  # the key of a list's, deque's or dict's place: all of it


def _keyed_parts(obj: Any) -> list[tuple[Any, Any, Any]]:
    """What `reachable` goes on to from ``obj``, each with the place that holds it where
    that place can be rebound: (holder, key, part); else (None, None, part)."""
    if type(obj) in (torch.Tensor, nn.Parameter, torch.Generator):
        return []
    if isinstance(obj, nn.Module):
        return [(None, None, type(obj).forward)]
    if isinstance(obj, type):
        return []
    if isinstance(obj, dict):
        return [(obj, key, part) for key, part in obj.items()]
    if isinstance(obj, _SEQUENCES):  # (a list's place is all of it; `_places` finds tensors)
        return [(None, None, part) for part in obj if type(part) not in _LEAVES]
    if isinstance(obj, functools.partial):
        return [(None, None, part) for part in (obj.func, *obj.args, obj.keywords)]
    if isinstance(obj, types.FunctionType):
        parts: list[tuple[Any, Any, Any]]
        parts = [(None, None, p) for p in (obj.__defaults__, obj.__kwdefaults__)]
        parts.append((vars(obj), "__wrapped__", getattr(obj, "__wrapped__", None)))
        for cell in obj.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                parts.append((cell, None, cell.cell_contents))
        scope = obj.__globals__
        parts.extend((scope, name, scope[name]) for name in obj.__code__.co_names if name in scope)
        return [p for p in parts if not isinstance(p[2], (type, types.ModuleType))]
    if callable(obj):
        return [(None, None, part) for part in _callable_parts(obj)]
    return []


# Leaves that hold nothing to find: skipped first (most arguments are these).
_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})
_LEAVES = _ATOMS | {torch.Tensor, nn.Parameter, torch.Generator}
_SEQUENCES = (list, tuple, set, frozenset, collections.deque)


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


def owner_of(fn: Callable[..., Any], first: Any = None) -> Any:
    """What learns which inputs a region's forward updates: the module it runs (bound, or
    as the first argument of its class's method, as `remat.apply` calls it), else its code.

    Not the `remat` wrapper: ``remat(layer)(x)`` makes a new one at every call.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    bound = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(bound, nn.Module):
        return bound
    function = getattr(fn, "__func__", fn)
    name = getattr(function, "__name__", None)
    if isinstance(first, nn.Module) and name and getattr(type(first), name, None) is function:
        return first
    return getattr(function, "__code__", type(fn))


_TENSOR, _VERSION = operator.attrgetter("tensor"), operator.attrgetter("_version")
_SLOT_VERSION, _SLOT_MEMORY = operator.attrgetter("version"), operator.attrgetter("memory")
_TRAINING = operator.attrgetter("training")


_TABLE, _NAME = operator.attrgetter("table"), operator.attrgetter("name")


class _Slot(NamedTuple):
    module: Any  # an nn.Module, or what learns about a region's inputs (see `owner_of`)
    table: dict[str, Any] | None  # None for an input
    name: str
    tensor: torch.Tensor
    version: int
    memory: int  # where its data lay at entry: assigning ``.data`` moves it, with no version bump


def _memory(t: torch.Tensor) -> int:
    """Where ``t``'s data lies (the plain tensor's, under torch.func wrappers); -1 if nowhere."""
    try:
        return t.data_ptr()
    except RuntimeError:  # a torch.func wrapper, or no storage (a subclass, a sparse tensor)
        pass
    try:
        return int(_torch_private.unwrap_all(t).data_ptr())
    except RuntimeError:
        return -1


def storage_of(t: torch.Tensor) -> Any:
    """The storage ``t`` views (the plain tensor's, under torch.func wrappers), or None for a
    tensor with none. Assigning ``.data`` gives a tensor another storage; resizing one (as
    FSDP frees and gathers parameters) keeps it. Held, it is never another's."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a torch.func wrapper, a subclass, sparse
        pass
    try:
        return _torch_private.unwrap_all(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def storage_id(storage: Any) -> int | None:
    """Which storage `storage_of` gave (while held, no other has its id)."""
    return None if storage is None else int(storage._cdata)


def same_storage(t: torch.Tensor, held: int | None) -> bool:
    """Whether ``t`` still views the storage of id ``held`` (`storage_id`)."""
    return storage_id(storage_of(t)) == held


def _memories(tensors: list[torch.Tensor]) -> list[int]:
    """`_memory` of each of ``tensors``."""
    try:
        return list(map(torch.Tensor.data_ptr, tensors))
    except RuntimeError:
        return list(map(_memory, tensors))


def _storage(t: torch.Tensor) -> int:
    """Which memory ``t`` is a view of (0: none, or empty)."""
    if t.layout != torch.strided:
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a wrapper subclass with no storage of its own
        return 0


class _Tree:
    """What `_submodules` found under some modules, and what tells it is still so; and the
    plan `ModuleState.capture` made for them, if any (`_Plan`).

    It holds no module, table or tensor: the modules by weak reference, the rest by their
    places among them. Dropped with the first module it was found from that is freed, it
    keeps no model alive, also where a submodule refers back to its model (a hook bound to
    it).
    """

    __slots__ = ("children", "keys", "kinds", "names", "parents", "plan", "refs", "roots", "sizes")

    def __init__(
        self,
        key: tuple[int, ...],
        modules: list[nn.Module],
        found: list[nn.Module],
        held: list[tuple[dict[str, Any], str, nn.Module]],
    ) -> None:
        drop = functools.partial(_drop_tree, key)
        roots = set(map(id, modules))
        self.refs = [weakref.ref(m, drop) if id(m) in roots else weakref.ref(m) for m in found]
        tables = list(map(_MODULES, found))
        self.sizes = list(map(len, tables))
        self.keys = list(itertools.chain.from_iterable(tables))  # their names, in order
        self.kinds = list(map(type, found))  # (FSDP2's ``fully_shard`` changes the class)
        position = {id(m): i for i, m in enumerate(found)}
        self.roots = [position[i] for i in key]  # where ``modules`` are among them
        # Each held submodule: the module whose table holds it, its name there, and where
        # it is among the modules (after them: None).
        owner = {id(table): i for i, table in enumerate(tables)}
        self.parents = [owner[id(parent)] for parent, _, _ in held]
        self.names = [name for _, name, _ in held]
        self.children = [position.get(id(child), len(found)) for _, _, child in held]
        self.plan: _Plan | None = None

    def modules(
        self, key: tuple[int, ...]
    ) -> tuple[list[nn.Module], list[tuple[dict[str, Any], str, nn.Module]]] | None:
        """The modules found, and where each submodule is held, if the tree is still so
        (checked in native loops)."""
        found: list[Any] = list(map(_CALL, self.refs))
        if list(map(type, found)) != self.kinds or [id(found[i]) for i in self.roots] != list(key):
            return None  # (a freed module reads NoneType)
        tables = list(map(_MODULES, found))
        if (
            list(map(len, tables)) != self.sizes
            or list(itertools.chain.from_iterable(tables)) != self.keys
        ):
            return None
        parents = list(map(tables.__getitem__, self.parents))
        children = list(map([*found, None].__getitem__, self.children))
        if list(map(id, map(dict.get, parents, self.names))) != list(map(id, children)):
            return None
        return found, list(zip(parents, self.names, children, strict=True))


def _drop_tree(key: tuple[int, ...], root: weakref.ref[nn.Module]) -> None:
    tree = _TREES.get(key)
    if tree is not None and any(ref is root for ref in tree.refs):
        _TREES.pop(key, None)  # (another thread may have cleared it)


_TREES: dict[tuple[int, ...], _Tree] = {}  # ids of the modules a region reaches -> tree
_CALL = weakref.ref.__call__
_MODULES = operator.attrgetter("_modules")


def _submodules(
    modules: list[nn.Module],
) -> tuple[_Tree, list[nn.Module], list[tuple[dict[str, Any], str, nn.Module]]]:
    """Every module under ``modules`` (themselves included), each once, depth first; where
    each submodule is held (its parent's table, its name); and their tree.

    Walked once per set of modules, then checked at each call in native loops: the same
    modules, classes and submodules, in tables of the same names.
    """
    key = tuple(map(id, modules))
    tree = _TREES.get(key)
    now = tree.modules(key) if tree is not None else None
    if tree is not None and now is not None:
        return tree, *now
    found, held = _walk(modules)
    if len(_TREES) > 1024:  # (a program that makes new modules at every call)
        _TREES.clear()
    tree = _TREES[key] = _Tree(key, modules, found, held)
    return tree, found, held


class _Plan(NamedTuple):
    """The slots `ModuleState.capture` found in some submodules' parameters and buffers,
    for its later calls while nothing it depends on changed: the same modules (its
    `_Tree`'s), no record was made or learned more since (`_GENERATION`), every module is in
    the same training mode, and the tables are the same, with the same names, each holding
    a plain tensor or parameter. Made only where no tensor is lazy or sharded by FSDP2.
    Modules by their place among the tree's: it holds none.
    """

    generation: int
    training: list[bool]  # each module's flag
    fsdp: type | None
    ids: list[int]  # ids of each module's parameter and buffer tables, in order
    keys: list[str]  # their names, in order
    modules: list[int]  # per slot: its module,
    tables: list[int]  # table (of ``ids``)
    names: list[str]  # and name
    snapshots: list[int]  # the slots copied at entry (updated, as learned)
    unlearned: list[int]  # modules with tensors and no record yet


_TABLES = operator.attrgetter("_parameters", "_buffers")
# The forward hooks a module call runs: each module's tables, and nn.Module's global ones.
_HOOK_TABLES = operator.attrgetter(
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_GLOBAL_HOOK_TABLES = operator.attrgetter(
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
)


def _hook_tables(submodules: list[nn.Module]) -> list[dict[Any, Any]]:
    """Every forward hook table a call of ``submodules`` reads, the global ones first."""
    tables = list(_GLOBAL_HOOK_TABLES(sys.modules[nn.Module.__module__]))
    return tables + list(itertools.chain.from_iterable(map(_HOOK_TABLES, submodules)))


def _hooks_moved(hooks: tuple[list[dict[Any, Any]], list[int] | None, list[Any]]) -> list[Any]:
    """The hook tables (`_hook_tables`) whose hooks are not those the forward left, as places
    holding those: a hook registered, removed or replaced before the backward."""
    tables, lengths, held = hooks
    if lengths is None or (
        list(map(len, tables)) == lengths
        and all(list(table.items()) == list(entry.items()) for table, entry in held)
    ):
        return []  # (the usual: no hook, or the same ones)
    entries = {id(table): entry for table, entry in held}
    places = []
    for table in tables:
        entry = entries.get(id(table), {})
        if list(table.items()) != list(entry.items()):
            places.append((table, _CONTENTS, entry))
    return places


_PLAIN = frozenset((torch.Tensor, nn.Parameter))


def _trivial(kind: type) -> bool:
    """Whether a tensor subclass has torch's own torch function (or none, as a parameter)
    and dispatch: its ops run as a plain tensor's, at most re-wrapping their outputs (what
    it holds is not read)."""
    function = getattr(kind, "__torch_function__", None)
    return (
        getattr(function, "__func__", function) in _TORCH_FUNCTIONS
        and getattr(kind, "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__
    )


_TORCH_FUNCTIONS = (
    torch.Tensor.__torch_function__.__func__,  # type: ignore[attr-defined]
    torch._C._disabled_torch_function_impl,
)


def _planned(
    plan: _Plan | None,
    training: list[bool],
    tables: list[dict[str, Any]],
    fsdp: type | None,
) -> list[torch.Tensor] | None:
    """The tensors of ``plan``'s slots, in order, if it still holds (checked in native loops)."""
    if (
        plan is None
        or plan.generation != _GENERATION
        or plan.fsdp is not fsdp
        or plan.training != training
        or list(map(id, tables)) != plan.ids
        or list(itertools.chain.from_iterable(tables)) != plan.keys
    ):
        return None
    tensors = list(itertools.chain.from_iterable(map(dict.values, tables)))
    return tensors if _PLAIN.issuperset(map(type, tensors)) else None


def _plan(
    tree: _Tree,
    found: list[nn.Module],
    state: ModuleState,
    tables: list[dict[str, Any]],
    fsdp: type | None,
    generation: int,
    start: int,
    unlearned: list[nn.Module],
) -> None:
    """Keep, for ``tree``, the slots that `ModuleState.capture` found from ``start`` on."""
    slots = state.slots[start:]
    keys = list(itertools.chain.from_iterable(tables))
    if len(slots) != len(keys) or not _PLAIN.issuperset(map(type, map(_TENSOR, slots))):
        return  # (a None in a table)
    position = {id(m): i for i, m in enumerate(found)}
    where = {id(table): i for i, table in enumerate(tables)}
    tree.plan = _Plan(
        generation,
        [training for _, training in state.modes],
        fsdp,
        list(map(id, tables)),
        keys,
        [position[id(slot.module)] for slot in slots],
        [where[id(slot.table)] for slot in slots],
        list(map(_NAME, slots)),
        [i - start for i in state.snapshots if i >= start],
        [position[id(m)] for m in unlearned],
    )


def _walk(
    modules: list[nn.Module],
) -> tuple[list[nn.Module], list[tuple[dict[str, Any], str, nn.Module]]]:
    found: list[nn.Module] = []
    held: list[tuple[dict[str, Any], str, nn.Module]] = []
    seen: set[int] = set()
    for module in modules:  # (one compiled in place runs its region when Dynamo falls back)
        if _torch_private.compiled(module, in_place=False):
            raise compiled(f"reached a compiled {type(module).__name__}")
    stack: list[Any] = modules[::-1]
    while stack:
        module = stack.pop()
        if module is not None and id(module) not in seen:
            seen.add(id(module))
            found.append(module)
            table = module._modules
            for name, child in table.items():
                if isinstance(child, torch.jit.ScriptModule):
                    kind = type(child).__name__
                    raise scripted(
                        f"reached TorchScript {kind} `{name}` of {type(module).__name__}"
                    )
                if _torch_private.compiled(child):
                    raise compiled(f"reached compiled module `{name}` of {type(module).__name__}")
                held.append((table, name, child))
            stack.extend(reversed(table.values()))
    for cls in {type(module): None for module in found}:
        _refuse_compiled_methods(cls)
    return found, held


def _refuse_compiled_methods(kind: type) -> None:
    """Raise if a module class (or a base, but nn.Module) defines a method
    ``@torch.compile`` made. Each class is looked at once, until it has one."""
    if kind in _PLAIN_CLASSES:
        return
    for base in kind.__mro__:
        if base is nn.Module:
            break
        for name, value in vars(base).items():
            value = getattr(value, "__func__", value)  # (a static or class method's)
            if type(value) is types.FunctionType and _torch_private.compiled(value):
                raise compiled(f"reached compiled method `{base.__name__}.{name}`")
    _PLAIN_CLASSES.add(kind)


_PLAIN_CLASSES: weakref.WeakSet[type] = weakref.WeakSet()  # module classes with none


def _sharded_units(submodules: list[nn.Module], fsdp: type | None) -> set[int]:
    """Ids of the modules inside FSDP2 units (the units included): FSDP2 owns their parameters."""
    owned: set[int] = set()
    if fsdp is not None and any(map(isinstance, submodules, itertools.repeat(fsdp))):
        for sub in submodules:
            if id(sub) not in owned and isinstance(sub, fsdp):
                owned.update(id(m) for m in sub.modules())
    return owned


_UNINITIALIZED = (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)
aten = torch.ops.aten
# The kernels that write the running statistics (arguments 3 and 4) in training.
BATCH_NORM_OPS = frozenset(
    {aten.native_batch_norm.default, aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default}
)


def _rewound(t: torch.Tensor) -> bool:
    """Whether a module tensor the forward updated is rewound in place for the recompute
    (`ModuleState.pinned`) rather than copied: a plain strided tensor or parameter with no
    autograd history (batch norm's running statistics, an average a module keeps, a
    parameter). Others (a tensor subclass, a torch.func wrapper) get private copies."""
    return (
        type(t) in _PLAIN
        and t.layout == torch.strided
        and t.grad_fn is None
        and _torch_private.unwrap_all(t) is t
    )


class ModuleState:
    """The parameter and buffer slots of some modules, as the region's forward saw them.

    Also the region's inputs that do not require grad, and the tensors ``fn`` reaches by
    reference (`loose`), whose versions tell whether the forward wrote them.
    """

    __slots__ = (
        "attributes",
        "before",
        "chains",
        "copies",
        "ended",
        "generators",
        "held",
        "hooks",
        "inputs",
        "learners",
        "loose",
        "loose_storages",
        "lost",
        "modes",
        "places",
        "rewound",
        "seen_as",
        "settled",
        "sharded",
        "slots",
        "snapshots",
        "taken",
        "uninitialized",
        "watching",
        "written",
    )

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.inputs = 0  # how many of them are the region's inputs (the first)
        self.snapshots: dict[int, torch.Tensor] = {}  # slot index -> value before the forward
        # Updated slots the recompute rewinds in place (`_rewound`): slot index -> the
        # value at entry.
        self.rewound: dict[int, torch.Tensor] = {}
        self.generators: list[Any] = []  # explicit torch.Generators kept as module attributes
        # Slots whose tensors torch.func wrapped (``vmap`` batches ``functional_call``'s
        # buffers, and arguments): slot index -> the wrappers (`wrapper_chain`), for the
        # recompute's copy, and the plain tensor's version at entry (a wrapper's does not
        # move with it). Their snapshots are of the plain tensor.
        self.chains: dict[int, tuple[list[tuple[int, int | None, bool]], int]] = {}
        self.sharded: list[_Slot] = []  # FSDP2's sharded parameters, for their versions only
        self.uninitialized: list[str] = []  # a lazy module's tensors, not made yet
        # Reached by reference, and their versions (at entry, then when the forward ended).
        self.loose: list[tuple[torch.Tensor, int]] = []
        self.loose_storages: list[Any] = []  # each one's `storage_of`, at entry
        # A watched forward (the first of some module or owner in this training mode): what
        # learns from it, the slots' memory at entry, and the slots it wrote (`before_write`).
        self.watching = False
        self.learners: list[Any] = []
        self.seen_as: tuple[Any, Any] | None = None  # (owner, the call's key in `_Learned.seen`)
        self.before: dict[int, torch.Tensor] = {}
        # A watched forward: copies of its buffers and arguments at entry, which tell a
        # write no op shows (through ``.numpy()``, a kernel given a raw pointer).
        self.copies: dict[int, torch.Tensor] = {}
        self.taken: set[int] = set()
        self.settled = False  # the forward ended
        self.ended: list[int] = []  # slot index -> version when the forward ended
        self.lost: list[_Slot] = []  # updated by the forward, with no snapshot
        self.written: list[torch.Tensor] = []  # loose tensors the forward wrote
        # Every module's training flag at entry: the recompute runs in the forward's modes
        # (a model switched to ``eval()`` before the backward).
        self.modes: list[tuple[nn.Module, bool]] = []
        # Where each submodule was held at entry: the recompute runs the forward's (a
        # submodule replaced before the backward, as a teacher swap does).
        self.held: list[tuple[dict[str, Any], str, nn.Module]] = []
        # Each submodule's ``__dict__``, and a copy of it at entry: the recompute sees what
        # the forward read where ``fn`` rebinds an attribute (`_rebound`).
        self.attributes: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
        # The forward hook tables a call of the submodules reads; their lengths, and a copy
        # of the ones with hooks, as the forward left them (a lazy module's hook removes
        # itself) without those it added (``fn`` registers them again, behind a flag it sees
        # unset): the recompute runs those (`_hooks_moved`). Until the forward ends, the
        # hooks each table held at entry, by handle id.
        self.hooks: tuple[list[dict[Any, Any]], list[int] | None, list[Any]] = ([], None, [])
        # Where ``fn`` found the `loose` tensors (`Reached.places`): the recompute reads
        # what the forward read there (a closure variable rebound before the backward).
        self.places: list[tuple[Any, Any, Any]] = []

    @classmethod
    def capture(
        cls, owner: Any, reached: Reached, leaves: list[Any], structure: Any
    ) -> ModuleState | None:
        """The state of a region about to run: slots, and snapshots of what it updates.

        A slot is snapshotted at entry once a forward was seen to update it. A forward is
        watched instead (`before_write`), so nothing is copied that it does not write, and
        its recompute is guarded (`WriteGuard`), when it is the first of a module, or of
        the owner, in its training mode, or the first of the owner with arguments of this
        tree ``structure`` (the leaves' positions name its inputs) and leaf types (and bool
        values) that reaches the objects it reaches whose attributes remat does not search
        (`Reached.opaque`).
        """
        learned = _learned(owner)
        # A tensor where a None was, or a flag flipped, may update other tensors.
        kinds = tuple(leaf if type(leaf) is bool else type(leaf) for leaf in leaves)
        key = (structure, kinds, tuple(reached.opaque))
        seen = learned is not None and key in learned.seen
        # Unseen: every input is watched, as its positions may show other tensors now.
        inputs_updated = learned.updated if seen and learned is not None else None
        input_slots = [
            (f"input {i}", x)
            for i, x in enumerate(leaves)
            if isinstance(x, torch.Tensor)
            and not x.requires_grad
            and (inputs_updated is None or f"input {i}" in inputs_updated)
        ]
        if seen and not (input_slots or reached.modules or reached.tensors or reached.places):
            return None  # (what the end finds, sooner: a function that reaches no module)
        state = cls()
        for name, x in input_slots:
            if inputs_updated is not None:
                state.snapshots[len(state.slots)] = state._snapshot(len(state.slots), x)
            else:
                state._wrapped(len(state.slots), x)
            state.slots.append(_Slot(owner, None, name, x, x._version, _memory(x)))
        state.inputs = len(state.slots)
        unlearned = [] if seen else [owner]
        roots = reached.modules
        tree, submodules, state.held = _submodules(roots)
        own = list(map(vars, submodules))
        # Modules held in the modules' own attributes (a plain list of blocks, a wrapper
        # function as ``self.inner = remat(block)``): the region's all the same. Looked
        # for at every call, as such attributes change without the tree's tables showing it.
        places, extra = _contents(own, submodules)
        while extra:
            roots = roots + extra
            tree, submodules, state.held = _submodules(roots)
            own = list(map(vars, submodules))
            places, extra = _contents(own, submodules)
        state.attributes = own, list(map(dict.copy, own))
        tables = _hook_tables(submodules)
        state.hooks = tables, None, [(table, set(table)) for table in filter(None, tables)]
        training = list(map(_TRAINING, submodules))
        state.modes = list(zip(submodules, training, strict=True))
        fsdp, dtensor = _fsdp_types()
        owned = _sharded_units(submodules, fsdp)
        slots = state.slots
        # The types of every submodule's attributes, in one pass of native code.
        values = itertools.chain.from_iterable(map(dict.values, own))
        attribute_types = set(map(type, values))
        # Not isinstance: torch.Generator's metaclass makes it slow, on every attribute.
        if torch.Generator in attribute_types:
            state.generators = [
                v for sub in submodules for v in vars(sub).values() if type(v) is torch.Generator
            ]
        tables = list(itertools.chain.from_iterable(map(_TABLES, submodules)))
        plan = tree.plan
        tensors = _planned(plan, training, tables, fsdp)
        if tensors is not None:
            assert plan is not None
            unlearned += map(submodules.__getitem__, plan.unlearned)
            start = len(slots)
            modules = map(submodules.__getitem__, plan.modules)
            fields = zip(
                modules, map(tables.__getitem__, plan.tables), plan.names, tensors,
                map(_VERSION, tensors),
                _memories(tensors), strict=True,
            )  # fmt: skip
            slots += map(tuple.__new__, itertools.repeat(_Slot), fields)  # (native: per slot)
            for i in plan.snapshots:
                state.snapshots[start + i] = state._snapshot(start + i, tensors[i])
        else:
            generation, start, first = _GENERATION, len(slots), len(unlearned)
            for sub in submodules:
                record = _learned(sub)
                if record is None and (sub._parameters or sub._buffers):
                    unlearned.append(sub)
                updated = record.updated if record is not None else ()
                for table in (sub._parameters, sub._buffers):
                    for name, t in table.items():
                        if t is None:
                            continue
                        if type(t) in _UNINITIALIZED:  # a lazy module's, until its first forward
                            state.uninitialized.append(f"{type(sub).__name__}.{name}")
                            continue  # (the recompute reads what that forward made)
                        if table is sub._parameters and id(sub) in owned:
                            if dtensor is not None and isinstance(t, dtensor):
                                state.sharded.append(_Slot(sub, table, name, t, t._version, -1))
                            continue
                        if name in updated:
                            state.snapshots[len(slots)] = state._snapshot(len(slots), t)
                        slots.append(_Slot(sub, table, name, t, t._version, _memory(t)))
            if not (owned or state.uninitialized):
                _plan(tree, submodules, state, tables, fsdp, generation, start, unlearned[first:])
        if torch.Tensor in attribute_types:
            state._attributes(submodules, unlearned)
        if state.snapshots:
            state._rewind()
        state.places = reached.places + places
        if reached.tensors:
            known = {id(slot.tensor) for slot in slots}.union(map(id, leaves))
            state.loose = [(t, t._version) for t in reached.tensors if id(t) not in known]
            state.loose_storages = [storage_of(t) for t, _ in state.loose]
        state.seen_as = owner, key
        if unlearned:
            state.watching, state.learners = True, unlearned
            with _torch_private.functorch_cleared():  # plain aliases, outside any level
                state.before = {
                    i: state._wrapped(i, slot.tensor).detach() for i, slot in enumerate(state.slots)
                }
                with torch.no_grad():
                    state.copies = {
                        i: state.before[i].clone()
                        for i, slot in enumerate(state.slots)
                        if slot.table is None or slot.table is not slot.module._parameters
                    }
        held = state.slots or state.loose or state.sharded or submodules
        return state if held or state.places or state.watching else None

    def _rewind(self) -> None:
        """Of the slots with snapshots, those `_rewound` allows are rewound in place
        (`rewound`); not one whose memory another such slot shows (an argument viewing it:
        copied as one, `_viewing`), nor one whose tensor shows other memory now (``.data``
        assigned: the forward read the old)."""
        slots = self.slots
        memories = collections.Counter(_storage(slots[i].tensor) for i in self.snapshots)
        for i in list(self.snapshots):
            slot = slots[i]
            if (
                slot.table is not None
                and _rewound(slot.tensor)
                and memories[_storage(slot.tensor)] == 1
                and _memory(slot.tensor) == slot.memory
            ):
                self.rewound[i] = self.snapshots.pop(i)

    def in_place(self) -> list[torch.Tensor]:
        """The tensors the recompute rewinds in place (`rewound`): no copy stands for them."""
        return [self.slots[i].tensor for i in self.rewound]

    def restored(self) -> set[int]:
        """The lists, dicts and deques whose whole contents the recompute shows as the
        forward began (`pinned`), and gives back after it: ids."""
        return {id(holder) for holder, key, _ in self.places if key is _CONTENTS}

    def _attributes(self, submodules: list[nn.Module], unlearned: list[Any]) -> None:
        """Each module's plain tensor attributes (a cache, a mask) as slots, as its buffers
        are; but one that shares memory with another slot (HF's rotary embedding keeps its
        buffer as one; a view of a buffer): the recompute shows it the same view of that
        slot's copy (`_stand_ins`), or the slot's own memory, rewound (`rewound`)."""
        slots = self.slots
        shared = {memory: i for i, memory in enumerate(map(_storage, map(_TENSOR, slots)))}
        for sub in submodules:
            table = vars(sub)
            record = _learned(sub)
            for name, t in table.items():
                if type(t) is not torch.Tensor:
                    continue
                memory = _storage(t)
                if memory in shared:
                    continue
                shared[memory] = len(slots)
                if record is None and sub not in unlearned:
                    unlearned.append(sub)
                if record is not None and name in record.updated:
                    self.snapshots[len(slots)] = self._snapshot(len(slots), t)
                slots.append(_Slot(sub, table, name, t, t._version, _memory(t)))

    def refuse_lazy(self, policy: Any) -> None:
        """Per-op policies record every op on the tensors they read, and a lazy module's
        uninitialized parameters refuse every read but their own initialization."""
        if self.uninitialized:
            raise RuntimeError(
                f"`remat`: the policy {policy!r} records each op of the region, and the lazy "
                f"module tensors {', '.join(self.uninitialized)} are not initialized yet. Run "
                "the model once before its first remat call (a forward under "
                "`torch.no_grad()` initializes them), or use the default policy."
            )

    def _wrapped(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Slot ``i``'s plain tensor; the wrappers around it, if any, go to `chains`."""
        plain = _torch_private.unwrap_all(t)
        if plain is not t:
            self.chains[i] = (_torch_private.wrapper_chain(t), plain._version)
        return plain

    def _snapshot(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """A copy of what slot ``i`` (tensor ``t``) holds at entry."""
        plain = self._wrapped(i, t)
        if plain is t:
            with torch.no_grad():
                return t.detach().clone()
        with _torch_private.functorch_cleared(), torch.no_grad():
            return plain.clone()

    def before_write(self, written: list[torch.Tensor]) -> None:
        """A watched forward is about to write ``written``: snapshot the slots they show."""
        for t in written:
            memory = _storage(t)
            if not memory:
                continue
            for i, before in self.before.items():
                if i not in self.snapshots and _storage(before) == memory:
                    with torch.no_grad():
                        self.snapshots[i] = before.clone()
                    self.taken.add(i)

    def settle(self) -> None:
        """End of the forward: keep snapshots of what it updated, learn what it updates."""
        self.settled = True
        hooks, _, began = self.hooks
        with_hooks = list(filter(None, hooks))
        copies = list(zip(with_hooks, map(dict.copy, with_hooks), strict=True))
        if began or copies:
            at_entry = {id(table): keys for table, keys in began}
            for table, copy in copies:
                for key in copy.keys() - at_entry.get(id(table), set()):
                    del copy[key]  # registered by this forward
        self.hooks = hooks, list(map(len, hooks)), copies
        slots = self.slots
        tensors = list(map(_TENSOR, slots))  # (native loops: this runs at every call)
        self.ended = list(map(_VERSION, tensors))
        # The usual: nothing snapshotted or written, no tensor moved: no slot is updated.
        quiet = (
            not (self.rewound or self.snapshots or self.taken or self.copies)
            and self.ended == list(map(_SLOT_VERSION, slots))
            and _memories(tensors) == list(map(_SLOT_MEMORY, slots))
        )
        for i, slot in enumerate(() if quiet else slots):
            if i in self.rewound:  # updated, as learned; the recompute rewinds it,
                if _memory(slot.tensor) == slot.memory:
                    continue
                self.snapshots[i] = self.rewound.pop(i)  # unless given other memory
            t = slot.tensor  # (if the forward replaced it, as it left the old one)
            moved = _memory(t) != slot.memory  # ``.data`` assigned
            snapshot = self.snapshots.get(i)
            if moved and snapshot is None and self.watching:
                snapshot = self.snapshots[i] = self.before[i]  # the memory it showed before
            updated = i in self.taken or moved or self.ended[i] != slot.version
            if not updated and snapshot is None and i in self.copies:
                snapshot = self.copies[i]  # a write that no op showed, if any
                updated = not _equal(snapshot, t)
                if updated:
                    self.snapshots[i] = snapshot
            elif snapshot is not None:
                # Learned as updated: some kernels (batch norm's running statistics, a fused
                # observer's) write without a version bump, and may leave the values as they
                # were. The recompute writes a private copy, as a per-op policy's must.
                updated = True
            if not updated:
                self.snapshots.pop(i, None)
                continue
            record = _learning(slot.module)
            record.learn(record.updated, slot.name)
            if i not in self.snapshots:
                self.lost.append(slot)
        for learner in self.learners:
            _learning(learner)
        if self.lost and self.seen_as is not None:
            # The next such call is watched again: it learns every write this forward made
            # (a batch norm's statistics, which show no version bump, beside its counter).
            owner, key = self.seen_as
            _learning(owner).seen.discard(key)
        elif self.watching and self.seen_as is not None:
            owner, key = self.seen_as
            seen = _learning(owner).seen
            if len(seen) > 64:  # an owner that reaches new objects at every call
                seen.clear()
            seen.add(key)
        if self.snapshots:
            self._rewind()
        self.before, self.taken, self.copies = {}, set(), {}
        self.written = [t for t, version in self.loose if t._version != version]
        self.loose = [(t, t._version) for t, _ in self.loose]

    def _viewing(self) -> dict[int, int]:
        """Slots the recompute copies that share memory with another such slot (a view of a
        buffer passed as an argument; a parameter tied in two modules), each with the one
        whose copy it views the same way: a module's (the largest). A tensor that requires
        grad shares only with itself (its copy is a leaf)."""
        slots, groups = self.slots, collections.defaultdict(list)
        for i in self.snapshots:
            t = slots[i].tensor
            if i not in self.chains and _storage(t):
                groups[(True, id(t)) if t.requires_grad else (False, _storage(t))].append(i)
        viewing: dict[int, int] = {}
        for group in groups.values():
            base = max(group, key=lambda i: (slots[i].table is not None, slots[i].tensor.numel()))
            viewing.update((i, base) for i in group if i != base)
        return viewing

    def _stand_ins(
        self, made: dict[int, torch.Tensor], copies: list[tuple[torch.Tensor, torch.Tensor, int]]
    ) -> list[tuple[Any, Any, Any]]:
        """Where the forward found a tensor sharing memory with a slot the recompute copies
        (``made``) outside its table, as it began: a module's attribute (HF's rotary
        embedding keeps its buffer as one), a place ``fn`` reaches (a closure cell, a
        global, a dict's entry), the contents of the lists, dicts and deques (and their
        subclasses) that modules hold or that lead ``fn`` to a tensor (`places`), and the
        tuples these hold. Swaps that put the same view of the copy there (a tuple holding
        one rebuilt); adds the views to ``copies``. Anywhere else (a set, a plain object's
        attribute), the recompute reads what the forward left, where its guard checks that
        the copy holds the same (`WriteGuard.before_read`)."""
        slots = self.slots
        copied = {memory: i for i in made if (memory := _storage(slots[i].tensor))}
        memo: dict[int, Any] = {}
        swaps: list[tuple[Any, Any, Any]] = []

        def stand_in(value: Any) -> Any:
            """``value`` as the recompute sees it (containers are places of their own)."""
            if id(value) in memo:
                return memo[id(value)]
            now = value
            i = copied.get(_storage(value)) if isinstance(value, torch.Tensor) else None
            if i is not None:
                now = _alias(made[i], slots[i].tensor, value)
                if now is None:
                    now = value  # (another dtype, other memory: the guard checks its reads)
                elif now is not made[i]:
                    copies.append((now, value, slots[i].version))
            elif isinstance(value, tuple) and _may_hold(value):
                items = list(map(stand_in, value))
                if any(map(operator.is_not, items, value)):
                    now = _rebuilt(value, items)
            memo[id(value)] = now
            return now

        for holder, key, value in self.places:
            if key is not _CONTENTS:
                if stand_in(value) is not value:
                    swaps.append((holder, key, memo[id(value)]))
                continue
            items = list(value.values() if isinstance(value, dict) else value)
            if not _may_hold(items):
                continue
            now = list(map(stand_in, items))
            if any(map(operator.is_not, now, items)):
                if isinstance(value, dict):
                    swaps.append((holder, _CONTENTS, dict(zip(value, now, strict=True))))
                else:
                    swaps.append((holder, _CONTENTS, tuple(now)))
        for table, entry in zip(*self.attributes, strict=True):
            for name in entry.keys() - _MODULE_OWN:
                if stand_in(entry[name]) is not entry[name]:
                    swaps.append((table, name, memo[id(entry[name])]))
        return swaps

    @contextlib.contextmanager
    def pinned(
        self, wrap: Callable[[list[tuple[int, int | None, bool]], torch.Tensor], torch.Tensor]
    ) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, int]]]:
        """Within the block, every slot shows what the forward read from it, every
        submodule is where it was, and every module is in the training mode the forward
        began in.

        ``wrap`` wraps a plain copy as a slot's wrappers (`chains`) did, at the
        recompute's levels.

        Yields the private copies, (copy, the forward's tensor, the version of its plain
        tensor then): it
        puts those of module slots in; the region passes those of its inputs. A copy
        requires grad as the tensor it stands for did, so the recompute records (and
        saves) what the forward did.
        """
        for slot in self.lost:
            raise _lost(slot)
        for loose in self.written:
            layout = describe_meta(loose.shape, loose.dtype, loose.device)
            raise RecomputeError(
                f"`remat`: the forward updated in place a tensor `fn` reaches by reference "
                f"({layout}: a closure variable, a global, a "
                "default or a container's element), which is neither an argument of `fn` nor "
                "a parameter or buffer of a module `fn` reaches. The recompute would update it "
                "a second time and read the updated value. Keep such state in a buffer of a "
                "module `fn` reaches (`register_buffer`), or pass it to `fn` as an argument."
            )
        for (loose, version), storage in zip(self.loose, self.loose_storages, strict=True):
            what = f"a tensor `fn` reaches by reference ({describe(loose)})"
            fix = "Modify it after the backward, or pass it to `fn` as an argument."
            if self.settled and loose._version != version:
                raise changed_since_forward(what, version, loose._version, fix)
            if not same_storage(loose, storage_id(storage)):
                raise data_replaced(what, fix)
        for slot in self.sharded:
            if slot.tensor._version != slot.version:
                raise changed_since_forward(
                    f"FSDP2's sharded parameter `{slot.name}` of {type(slot.module).__name__}",
                    slot.version,
                    slot.tensor._version,
                    "Step the optimizer after the backward.",
                )
        swaps: list[tuple[Any, Any, Any]] = []  # (holder, key, what the forward read there)
        copies: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        slots = self.slots
        # The usual: no copies to make, and every slot as the forward left it.
        tabled = slots[self.inputs :]  # (the inputs' slots come first, and have no table)
        unchanged = (
            self.settled
            and not (self.rewound or self.snapshots)
            and list(map(_VERSION, map(_TENSOR, slots))) == self.ended
            and list(map(id, map(dict.get, map(_TABLE, tabled), map(_NAME, tabled))))
            == list(map(id, map(_TENSOR, tabled)))
        )
        made: dict[int, torch.Tensor] = {}  # slot index -> its copy
        viewing = {} if unchanged or len(self.snapshots) < 2 else self._viewing()
        for i, slot in enumerate(() if unchanged else slots):
            if i in viewing:  # (after the copy it views)
                continue
            if i in self.rewound:
                assert slot.table is not None
                if _memory(slot.tensor) != slot.memory:  # (a recompute inside its forward)
                    raise _lost(slot)
                if slot.table.get(slot.name) is not slot.tensor:
                    swaps.append((slot.table, slot.name, slot.tensor))
                continue
            snapshot = self.snapshots.get(i)
            if snapshot is None and self.before and _memory(slot.tensor) != slot.memory:
                snapshot = self.before[i]  # inside a watched forward, after a `.data` assignment
            if snapshot is not None:
                wrapped = self.chains.get(i)
                if wrapped is None:
                    with torch.no_grad():
                        copy = snapshot.clone()
                else:  # plain (a level would wrap the clone), then wrapped as the slot was
                    with _torch_private.functorch_cleared(), torch.no_grad():
                        copy = snapshot.clone()
                    copy = wrap(wrapped[0], copy)
                plain = _torch_private.unwrap_all(copy)
                if slot.tensor.requires_grad and plain is copy:
                    copy.requires_grad_()
                # The copy counts versions from where the forward's plain tensor did, so its
                # views and ``.data`` aliases count theirs as the forward's did.
                version = slot.version if wrapped is None else wrapped[1]
                _torch_private.set_version(plain, version)
                if slot.table is not None:
                    swaps.append((slot.table, slot.name, copy))
                copies.append((copy, slot.tensor, version))
                made[i] = copy
                continue
            if slot.table is None:  # an input: the region checks its version itself
                continue
            if not self.settled and _memory(slot.tensor) != slot.memory:
                raise _lost(slot)  # ``.data`` assigned, in a forward not watched yet
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
        for i, base in viewing.items():
            slot = slots[i]
            view = _alias(made[base], slots[base].tensor, slot.tensor)
            if view is None:  # (not a view of it: a copy of its own)
                with torch.no_grad():
                    view = self.snapshots[i].clone()
                _torch_private.set_version(view, slot.version)
            made[i] = view
            if view is not made[base]:
                copies.append((view, slot.tensor, slot.version))
            if slot.table is not None:
                swaps.append((slot.table, slot.name, view))
        for held in self.held:
            if held[0].get(held[1]) is not held[2]:
                swaps.append(held)
        tables, entries = self.attributes
        if not _same_tables(tables, entries):  # (the usual: all as they were)
            for table, entry in zip(tables, entries, strict=True):
                swaps += _rebound(table, entry)
        swaps += filter(_moved, self.places)
        if made:
            swaps += self._stand_ins(made, copies)
        swaps += _hooks_moved(self.hooks)
        previous: list[tuple[Any, Any, Any]] = []
        flipped = [(m, m.training) for m, training in self.modes if m.training != training]
        places: list[tuple[Any, Any, Any]] = []
        started: list[dict[str, Any]] = []
        rewound: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        try:
            if self.rewound:
                with torch.no_grad():
                    for i, at_entry in self.rewound.items():
                        t = slots[i].tensor
                        rewound.append((t, t.clone(), t._version))
                        t.copy_(at_entry)
                        _torch_private.set_version(t, slots[i].version)
            for holder, key, value in swaps:
                previous.append((holder, key, _get(holder, key)))
                _put(holder, key, value)
            for module, training in flipped:
                module.training = not training
            # As the recompute starts: what it may write that its forward wrote and undid (a
            # depth counter, a stack), which an early stop leaves written.
            places = [(holder, key, _get(holder, key)) for holder, key, _ in self.places]
            started = list(map(dict.copy, tables))
            yield copies
        finally:
            if rewound:
                with torch.no_grad():
                    for t, now, version in rewound:
                        t.copy_(now)
                        _torch_private.set_version(t, version)
            for place in filter(_moved, places):
                _put(*place)
            if started and not _same_tables(tables, started):
                for table, entry in zip(tables, started, strict=True):
                    for holder, key, value in _rebound(table, entry):
                        _put(holder, key, value)
            for holder, key, value in reversed(previous):
                _put(holder, key, value)  # (`_ABSENT`: deleted between forward and backward)
            for module, training in flipped:
                module.training = training


_ABSENT = object()


# nn.Module's own attributes: its tables, hooks and training flag (slots, `held` and
# `modes` show the recompute what they held).
_MODULE_OWN = frozenset(vars(nn.Module()))
_CONTAINERS = (list, dict, collections.deque)


def _contents(
    tables: list[dict[str, Any]], modules: list[nn.Module]
) -> tuple[list[tuple[Any, Any, Any]], list[nn.Module]]:
    """What ``modules``' own attributes (``tables``; not nn.Module's tables) hold, at any
    depth, also inside tuples:

    - the lists, dicts and deques (and their subclasses: an ``OrderedDict``, a
      ``defaultdict``), each with its contents now, as places (`_places`): the recompute
      sees what the forward read from one that ``fn`` appends to, or that the caller
      changes before the backward (``cfg["attn"]["t"]``);
    - the modules not among ``modules``, also in sets, through a function that wraps one
      (``__wrapped__``), a bound method or a partial.

    Raises on compiled code among them (a module or function ``torch.compile`` made).
    """
    places, found = [], []
    seen: set[int] = set()
    known: set[int] = set()  # (the modules' ids, once one is met)
    held = [table[name] for table in tables for name in table.keys() - _MODULE_OWN]
    while held:
        value = held.pop()
        kind = type(value)
        if kind in _LEAVES or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (tuple, *_CONTAINERS)):
            items: Any = value  # (a tuple is immutable: only what it holds)
            if not isinstance(value, tuple):
                contents = _get(value, _CONTENTS)
                places.append((value, _CONTENTS, contents))
                items = contents.values() if isinstance(contents, dict) else contents
            if not _LEAVES.issuperset(map(type, items)):  # (natively: a list of numbers)
                held += items
        elif isinstance(value, nn.Module):
            if _torch_private.compiled(value):
                raise compiled(f"reached a compiled {type(value).__name__} in an attribute")
            known = known or set(map(id, modules))
            if id(value) not in known:
                found.append(value)
        elif isinstance(value, (set, frozenset)):
            held += value
        elif kind is types.FunctionType:
            if _torch_private.compiled(value):
                raise compiled(f"reached compiled function `{value.__qualname__}`")
            held.append(getattr(value, "__wrapped__", None))
        elif kind is types.MethodType:
            held.append(value.__func__)
        elif kind is functools.partial:
            held += [value.func, *value.args, *value.keywords.values()]
    return places, found


def _same_tables(tables: list[dict[str, Any]], entries: list[dict[str, Any]]) -> bool:
    """Whether each table holds what its entry holds (by identity), under the same keys in
    the same order (in native loops, with no ids made: this runs at every recompute)."""
    chain = itertools.chain.from_iterable
    held, were = chain(map(dict.values, tables)), chain(map(dict.values, entries))
    return (
        list(map(len, tables)) == list(map(len, entries))
        and all(map(operator.is_, held, were))
        and list(chain(tables)) == list(chain(entries))
    )


def _rebound(table: dict[str, Any], entry: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
    """A module's own attributes that were rebound, added or deleted since the forward's
    ``entry`` (``self.calls += 1``, a cache first set from None), as places holding the
    forward's (`pinned`); not its tensors, which its slots show the recompute."""
    swaps = []
    for name in (table.keys() | entry.keys()) - _MODULE_OWN:
        before = entry.get(name, _ABSENT)
        if not isinstance(before, torch.Tensor) and table.get(name, _ABSENT) is not before:
            swaps.append((table, name, before))
    return swaps


def _may_hold(items: Any) -> bool:
    """Whether ``items`` include a tensor or a tuple (their types found natively)."""
    return any(issubclass(kind, (torch.Tensor, tuple)) for kind in set(map(type, items)))


def _kind(holder: Any) -> Any:
    """The built-in container type whose methods read and write ``holder`` (`_get`, `_put`):
    a subclass's own (a read-only dict's, a list's that hides entries) are not called."""
    if isinstance(holder, dict):
        return collections.OrderedDict if isinstance(holder, collections.OrderedDict) else dict
    return collections.deque if isinstance(holder, collections.deque) else list


def _get(holder: Any, key: Any) -> Any:
    """What a place holds: a closure cell's contents (``key`` None), a dict's entry, a
    list's, deque's or dict's contents (`_CONTENTS`)."""
    if type(holder) is types.CellType:
        try:
            return holder.cell_contents
        except ValueError:  # (an empty cell)
            return _ABSENT
    kind = _kind(holder)
    if key is not _CONTENTS:
        return kind.get(holder, key, _ABSENT)  # (a deleted entry)
    if isinstance(holder, dict):
        return dict(kind.items(holder))
    return tuple(kind.__iter__(holder))


def _put(holder: Any, key: Any, value: Any) -> None:
    """Put ``value`` in a place (`_get`), through the container's built-in methods: a
    subclass's own (a read-only dict's) are not called."""
    if type(holder) is types.CellType:
        if value is _ABSENT:
            del holder.cell_contents
        else:
            holder.cell_contents = value
        return
    kind = _kind(holder)
    if key is not _CONTENTS:
        if value is _ABSENT:
            kind.__delitem__(holder, key)
        else:
            kind.__setitem__(holder, key, value)
    elif kind is list:
        list.__setitem__(holder, slice(None), value)
    elif kind is collections.deque:
        collections.deque.clear(holder)
        collections.deque.extend(holder, value)
    else:
        kind.clear(holder)
        for entry, item in value.items():
            kind.__setitem__(holder, entry, item)


def _moved(place: tuple[Any, Any, Any]) -> bool:
    """Whether a place holds something else than it did (`_places`), and can be put back:
    not a dict's deleted entry, which would come back last (``fn`` may iterate the dict),
    unless the dict is a module's globals."""
    holder, key, value = place
    now = _get(holder, key)
    if now is _ABSENT and key is not None and key is not _CONTENTS:
        module = sys.modules.get(holder.get("__name__", ""))
        return getattr(module, "__dict__", None) is holder
    if key is not _CONTENTS:
        return now is not value
    if isinstance(value, dict):  # (in order: ``fn`` may iterate it; the same keys, in order)
        return list(now) != list(value) or not all(map(operator.is_, now.values(), value.values()))
    return len(now) != len(value) or not all(map(operator.is_, now, value))  # (natively)


def _alias(copy: torch.Tensor, base: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
    """``t``, which shares the memory of ``base``, as the same view of ``copy`` (the
    recompute's copy of ``base``; with no autograd history where ``t`` has none: a
    parameter's detached view; through its bytes for a view of another dtype). None where
    it is no such view (memory outside ``base``'s)."""
    if t is base:
        return copy
    if copy.stride() != base.stride():
        return None
    viewed = copy.detach() if copy.requires_grad and not t.requires_grad else copy
    try:
        if t.dtype == base.dtype:
            offset = copy.storage_offset() + t.storage_offset() - base.storage_offset()
            view = viewed.as_strided(t.shape, t.stride(), offset)
            view = view.conj() if t.is_conj() else view  # (the bits `as_strided` drops)
            return torch._neg_view(view) if t.is_neg() else view
        flat = viewed.unsqueeze(0) if viewed.dim() == 0 else viewed
        raw, size = flat.view(torch.uint8), t.element_size()  # (its bytes, in place)
        start = t.storage_offset() * size - base.storage_offset() * base.element_size()
        shape, stride = (*t.shape, size), (*(s * size for s in t.stride()), 1)
        return raw.as_strided(shape, stride, raw.storage_offset() + start).view(t.dtype)[..., 0]
    except RuntimeError:  # (memory outside ``base``'s; bytes it cannot view so)
        return None


def _rebuilt(value: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    """A tuple like ``value`` holding ``items`` (a named tuple's type); ``value`` itself
    where its type makes none."""
    kind = type(value)
    if kind is tuple:
        return tuple(items)
    make = getattr(kind, "_make", None)
    return value if make is None else make(items)


def _equal(snapshot: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` holds ``snapshot``'s values (its plain tensor's, under torch.func)."""
    plain = _torch_private.unwrap_all(t)
    with contextlib.nullcontext() if plain is t else _torch_private.functorch_cleared():
        try:
            return torch.equal(snapshot, plain)
        except (RuntimeError, NotImplementedError, AttributeError):  # no kernel for it
            return _same_bytes(snapshot, plain)


def _same_bytes(snapshot: torch.Tensor, t: torch.Tensor) -> bool:
    """`_equal` where ``torch.equal`` has no kernel: a strided tensor's bytes (complex32,
    bits8); a sparse, nested or meta tensor by its version alone (only ops, which count
    versions, write one)."""
    if t.layout is not torch.strided or t.is_nested or t.is_meta:
        return True
    as_bytes = [x.contiguous().reshape(-1).view(torch.uint8) for x in (snapshot, t)]
    return torch.equal(*as_bytes)


def _stale(func: Any, t: torch.Tensor) -> RecomputeError:
    return RecomputeError(
        f"`remat`: the recompute's {func.overloadpacket} at {source_line()} reads or writes a "
        f"tensor ({describe_meta(t.shape, t.dtype, t.device)}) that shows the memory of a module "
        "tensor the forward updated in place, and holds other values than the recompute's "
        "private copy of it (what the forward left, not what it read). remat gives torch calls "
        "the copy in its place, but not this one: it ran with torch functions disabled, or "
        "under a torch.func transform, or viewed that memory in a way the copy cannot. Read "
        "it from its module (or with torch functions enabled)."
    )


# The torch functions that run a batch norm kernel, which writes the running statistics in
# training with no version bump: where each takes them, and its training flag.
_BATCH_NORMS: dict[Any, tuple[int, int, int]] = {
    nn.functional.batch_norm: (1, 2, 5),
    torch.batch_norm: (3, 4, 5),
    torch.native_batch_norm: (3, 4, 5),
    torch._native_batch_norm_legit: (3, 4, 5),
    torch._batch_norm_impl_index: (3, 4, 5),
    torch.cudnn_batch_norm: (3, 4, 5),
    torch.miopen_batch_norm: (3, 4, 5),
}
_BATCH_NORM_ARGUMENTS = ("running_mean", "running_var", "training")
BATCH_NORM_FUNCTIONS = frozenset(_BATCH_NORMS)


class SecondUpdates:
    """A recompute's check of the batch norm kernels it runs, which write the running
    statistics in training with no version bump (nothing shows the forward's write).

    Statistics that are one of ``fn``'s arguments (``leaves``, the forward's), a module's
    tensor or a tensor reached by reference, and that the recompute would write as they are
    (not rewound, no private copy: ``copied`` holds the arguments', by id), were written by
    the forward already, as an earlier call did not write them: the check raises, naming
    them, before the kernel writes them a second time, and later calls keep them (learned).
    Called with each batch norm function the recompute's function mode sees
    (`BATCH_NORM_FUNCTIONS`), or with what a batch norm kernel writes, by remat's dispatch
    mode or `WriteGuard`. ``paths``: each tensor argument's, for the message.
    """

    __slots__ = ("copied", "known", "leaves", "owner", "paths", "state")

    def __init__(
        self,
        owner: Any,
        leaves: list[Any],
        copied: dict[int, Any],
        paths: Callable[[], list[str]],
        state: ModuleState | None,
    ) -> None:
        self.owner, self.leaves, self.copied, self.paths = owner, leaves, copied, paths
        self.state = state
        # id -> (what learns of it, its name there, and what it is: a str, or an argument's
        # place among the tensor arguments), made at the first batch norm
        self.known: dict[int, tuple[Any, str, str | int]] | None = None

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        places = _BATCH_NORMS[func]
        found = [
            args[i] if i < len(args) else kwargs.get(name)
            for i, name in zip(places, _BATCH_NORM_ARGUMENTS, strict=True)
        ]
        if found[2]:  # (in evaluation it reads them)
            self.written(func, [t for t in found[:2] if isinstance(t, torch.Tensor)])

    def written(self, func: Any, tensors: list[torch.Tensor]) -> None:
        known = self._known()
        written = [known[id(t)] for t in tensors if id(t) in known]
        for learner, name, _ in written:
            if learner is not None:
                record = _learning(learner)
                record.learn(record.updated, name)
        if not written:
            return
        names = [w if isinstance(w, str) else f"argument {self.paths()[w]}" for _, _, w in written]
        learned = all(learner is not None for learner, _, _ in written)
        raise RecomputeError(
            f"`remat`: the forward updated {' and '.join(names)} in place (the running "
            f"statistics of {getattr(func, '__name__', func)}, which show no version bump), "
            "which earlier calls of the region did not do, so remat had not kept their values "
            "from before the forward, and the recompute would update them a second time. "
            + (
                "Later calls keep them; update them outside `fn`, or make the update happen on "
                "the region's first call."
                if learned
                else "Keep such state in a buffer of a module `fn` reaches (`register_buffer`), "
                "or pass it to `fn` as an argument."
            )
        )

    def _known(self) -> dict[int, tuple[Any, str, str | int]]:
        if self.known is not None:
            return self.known
        known: dict[int, tuple[Any, str, str | int]] = {}
        tensors = [(i, x) for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)]
        for j, (i, x) in enumerate(tensors):
            if not x.requires_grad and id(x) not in self.copied:
                known[id(x)] = (self.owner, f"input {i}", j)
        state = self.state
        if state is not None:  # (its slots without a copy, not rewound: the originals)
            handled = state.snapshots.keys() | state.rewound.keys()
            for i, slot in enumerate(state.slots):
                if i >= state.inputs and i not in handled:
                    kind = type(slot.module).__name__
                    known[id(slot.tensor)] = (slot.module, slot.name, f"`{slot.name}` of {kind}")
            for t, _ in state.loose:
                known[id(t)] = (None, "", "a tensor `fn` reaches by reference")
        self.known = known
        return known


def _lost(slot: _Slot) -> RecomputeError:
    return RecomputeError(
        f"`remat`: the forward updated module tensor `{slot.name}` of "
        f"{type(slot.module).__name__} in place, which earlier calls of the region did not do, "
        "so remat had not kept its value from before the forward, and the recompute cannot "
        "read what the forward read. Later calls keep it; update it outside `fn`, or make the "
        "update happen on the region's first call."
    )


class WriteGuard:
    """A recompute's guard of the memory that existed before it.

    Where the forward updated a tensor, the recompute runs on a private copy that `pinned`
    puts wherever remat finds the tensor. The recompute may still find the tensor itself
    elsewhere (a set, a plain object's attribute, a closure a module holds: `live`): each
    torch call is given the same view of the copy instead (`standing`, from the recompute's
    function mode), reads outside aten (``.tolist()``) too. An op that still shows that
    memory (a call made with torch functions disabled) may read it only where it holds what
    the copy holds then (`before_read`), and never write it. The recompute of a watched
    forward (``writes``) may write no other memory from before it but the copies: any other
    write would repeat one the forward made to state remat cannot show the recompute as it
    was (a tensor reached in a way `reachable` does not follow).
    """

    __slots__ = (
        "copied", "live", "local", "made_here", "same", "second", "stand_in", "views", "writes",
    )  # fmt: skip

    def __init__(
        self, copies: list[tuple[torch.Tensor, torch.Tensor, int]], in_place: list[torch.Tensor]
    ) -> None:
        plain = _torch_private.unwrap_all
        # What the recompute may write: the copies, and the tensors rewound ``in_place``.
        self.local = {_storage(plain(copy)) for copy, _, _ in copies}
        self.local.update(map(_storage, in_place))
        # The memory of each tensor a copy stands for -> (the largest such copy, the tensor).
        self.live: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for copy, original, _ in copies:
            memory = _storage(plain(original))
            if memory and memory not in self.local:
                held = self.live.get(memory)
                if held is None or held[1].numel() < original.numel():
                    self.live[memory] = (plain(copy), plain(original))
        # A copy's memory -> (what it stands for, the copy), for `returned`.
        self.copied = {_storage(copy): (original, copy) for copy, original in self.live.values()}
        self.writes = False
        # A per-op policy's replay knows what the recompute made (`made` is not called), and
        # is told what each view of a copy stands for (`Replayer.stand_in`).
        self.made_here: Callable[[torch.Tensor], bool] | None = None
        self.stand_in: Callable[[torch.Tensor, torch.Tensor, int], None] | None = None
        self.same: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # (`_back`'s)
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (it, its view)
        # Raises, naming them, for running statistics remat knows (`SecondUpdates.written`).
        self.second: Callable[[Any, list[torch.Tensor]], None] | None = None

    def standing(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """``values`` (a torch call's arguments; lists and tuples in them too), where a tensor
        shows `live` memory, with the same view of its copy in its place (`_alias`): what
        the forward read or wrote there. One that is no such view (other memory, a
        torch.func wrapper) stays, for `before_read`. Run with remat's ops quiet."""
        changed: list[Any] | None = None
        for i, value in enumerate(values):
            now: Any
            if isinstance(value, torch.Tensor):
                now = self._view(value)
            elif isinstance(value, (list, tuple)) and type(value) in (list, tuple):
                items = [self._view(t) if isinstance(t, torch.Tensor) else t for t in value]
                now = value if all(map(operator.is_, items, value)) else type(value)(items)
            else:
                continue
            if now is not value:
                changed = changed or list(values)
                changed[i] = now
        return values if changed is None else tuple(changed)

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        held = self.views.get(id(t))
        if held is not None and held[0] is t:
            return held[1]
        memory = _storage(t)
        found = self.live.get(memory)
        kind = type(t)
        if (
            found is None
            or (kind not in _PLAIN and not _trivial(kind))
            or _torch_private.unwrap_all(t) is not t
        ):
            return t  # (its own torch function, a torch.func wrapper: see `before_read`)
        copy, original = found
        if _storage(copy) == memory:  # (``.data`` assigned it that memory)
            return t
        view = _alias(copy, original, t)
        if view is None:
            return t
        if _torch_private.rewraps_outputs(t):
            view = view.as_subclass(kind)
        if view is not copy and self.stand_in is not None:
            self.stand_in(view, t, view._version)
        self.views[id(t)] = (t, view)  # (one view per tensor: read twice, one tensor)
        return view

    def returned(self, out: Any, given: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        """What a torch call given ``given`` in place of ``args`` (`standing`) returned: an
        argument it returns (an in-place op's ``self``) as the caller's own, and a view of a
        copy that requires no grad (``.T``, ``.view(-1)``) as the same view of what the copy
        stands for, so that one kept in an object shows that tensor after the recompute, as
        the forward's does; a call that reads it gets the copy's view back (`views`)."""
        if type(out) in (list, tuple):  # (``split``, ``unbind``)
            items = [self._back(t, given, args) for t in out]
            return out if all(map(operator.is_, items, out)) else type(out)(items)
        return self._back(out, given, args)

    def _back(self, t: Any, given: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if given and t is given[0]:
            return args[0]
        found = self.copied.get(_storage(t))
        if found is None or t.requires_grad:
            return t
        back = _alias(*found, t)
        if back is None:
            return t
        if _torch_private.rewraps_outputs(t):
            back = back.as_subclass(type(t))
        self.views[id(back)] = (back, t)
        if self.same is not None:  # (read where `views` is not: inside a transform)
            self.same(back, t)
        return back

    def made(self, out: Any) -> None:
        """The outputs of one op of the recompute."""
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self.local.add(_storage(t))

    def before_read(self, func: Any, args: Any) -> None:
        """The recompute runs ``func`` on ``args``: those showing `live` memory must hold
        what the copy holds there (bitwise; all of it, for a view of another dtype)."""
        for arg in args:
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(t, torch.Tensor) and _storage(t) in self.live:
                    copy, original = self.live[_storage(t)]
                    view = _alias(copy, original, t)
                    same = view is not None and _same_bytes(view, t)
                    if not (same or _same_bytes(copy, original)):
                        raise _stale(func, t)

    def before_write(self, func: Any, written: list[torch.Tensor]) -> None:
        if self.second is not None and func in BATCH_NORM_OPS:
            self.second(func, written)
        for t in written:
            memory = _storage(t)
            if memory in self.live:
                raise _stale(func, t)
            if self.writes and memory and memory not in self.local:
                if self.made_here is not None and self.made_here(t):
                    continue
                raise RecomputeError(
                    f"`remat`: the recompute writes in place, with {func.overloadpacket} at "
                    f"{source_line()}, a tensor ({describe_meta(t.shape, t.dtype, t.device)}) "
                    "that existed before it and that remat gave it no private copy of: the "
                    "forward wrote it already (state held where remat does not look), or the "
                    "recompute writes what the forward did not. Keep state that `fn` updates "
                    "in a buffer of a module `fn` reaches (remat follows closures, globals, "
                    "defaults, partials, bound methods and containers), or pass it to `fn` "
                    "as an argument."
                )

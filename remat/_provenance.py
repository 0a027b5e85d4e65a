"""What the per-op policies know of each aten op, and where each tensor it reads came from.

A signature (`Provenance.signature`) is an op and its arguments, each tensor replaced by
where it came from: an earlier op's output at some in-place version, a region input by
position, or a tensor from outside by identity. The forward (`_keep`) and the recompute
(`_replayer`) each describe their ops this way; equal signatures compute equal values.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, NamedTuple

import torch

from . import _modules, _torch_private
from ._rng import is_random


def output_tensors(out: Any) -> list[torch.Tensor]:
    values = out if isinstance(out, (list, tuple)) else (out,)
    return [t for t in values if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Which memory ``t`` shows (equal keys: equal views of the same data), if it has any.

    Forward-mode AD makes zero tangents with no storage at all, and a wrapper subclass
    (a ``__torch_dispatch__`` one: DTensor, TwoTensor) keeps its data in tensors it holds.
    """
    memory = None if t._is_zerotensor() else data_start(t)
    if memory is None:
        return None
    return (memory, t.storage_offset(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())


aten = torch.ops.aten
# Ops that read only the shape, dtype and device of their tensor arguments.
_METADATA_ONLY = frozenset(
    {
        aten.empty_like,
        aten.zeros_like,
        aten.ones_like,
        aten.full_like,
        aten.rand_like,
        aten.randn_like,
        aten.randint_like,
        aten.new_empty,
        aten.new_empty_strided,
        aten.new_zeros,
        aten.new_ones,
        aten.new_full,
    }
)

READS_METADATA, ALWAYS_RUNS, VIEW, DECIDED = range(4)


class Op:
    """What the bookkeeping needs to know of an op overload, found once (`op_info`).

    Signatures and tables hold these rather than the overloads, which hash in Python.
    """

    __slots__ = (
        "func", "kind", "mutable", "random", "storage", "transparent", "view", "writes", "written",
    )  # fmt: skip

    def __init__(self, func: Any) -> None:
        self.func = func  # held: the cache's key is its id
        self.random = is_random(func)
        self.mutable = func._schema.is_mutable
        self.writes = self.mutable or func in _UNDECLARED_WRITES  # see `written`
        # The arguments its schema says it writes: (position, name).
        self.written = tuple(
            (i, argument.name)
            for i, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        self.view = func.is_view
        # It reads a storage (``set_`` onto memory): described before it runs (`Keeper.before`).
        self.storage = any(str(a.type) == "Storage" for a in func._schema.arguments)
        # Its output is its input's value: provenance passes through it (autograd adds
        # and drops detaches between one run and the next).
        self.transparent = func in (aten.detach.default, aten.alias.default)
        if func.overloadpacket in _METADATA_ONLY:
            self.kind = READS_METADATA
        elif self.random or self.mutable:
            self.kind = ALWAYS_RUNS
        else:
            self.kind = VIEW if self.view else DECIDED


_OPS: dict[int, Op] = {}


def op_info(func: Any) -> Op:
    op = _OPS.get(id(func))
    if op is None:  # one `Op` per overload, whichever thread made it first: signatures
        op = _OPS.setdefault(id(func), Op(func))  # compare them by identity
    return op


def _passes_through(op: Op, args: Any, out: Any) -> bool:
    """Whether view ``out`` is ``args[0]`` as it is: a detach, an alias, or a view that
    changes nothing (autograd makes one for an autograd.Function that returns its input, as
    FSDP2's post-backward hook does, and only when the hook runs)."""
    if op.transparent:
        return isinstance(out, torch.Tensor)
    first = args[0] if args else None
    return (
        isinstance(first, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and out.shape == first.shape  # (most views change it: the cheapest test first)
        and _geometry(out) == _geometry(first)
    )


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    """Where in its storage a tensor's values lie, and how they are read (a conjugate or
    negative view reads them otherwise)."""
    return (t.storage_offset(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())


def data_start(t: torch.Tensor) -> int | None:
    """Where ``t``'s data starts (`storage_key`'s first part); None where it has no storage."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other layouts
        return None


def output_version(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out._version
    return sum(t._version for t in output_tensors(out))


# Argument types that stand for themselves in a signature.
_SELF_DESCRIBING = frozenset(
    {int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)
_PARAMETER = torch.nn.Parameter
_PLAIN = (torch.Tensor, _PARAMETER)


class Made(NamedTuple):
    """A tensor an op of the region made: which op, which output, at which version."""

    ref: weakref.ref[torch.Tensor]
    op: int
    position: int
    made_at: int


# A tensor from outside the region: (ref, its number, its version and ``requires_grad``
# when the forward first read it).
Outside = tuple[weakref.ref[torch.Tensor], int, int, bool]


class Provenance:
    """Where the tensors an op reads come from, for signatures (one per forward or recompute)."""

    __slots__ = (
        "aliases",
        "count",
        "earlier",
        "forward",
        "held",
        "inputs",
        "made",
        "made_outside",
        "outside",
        "shared",
        "twins",
        "viewed",
    )

    def __init__(
        self,
        inputs: list[torch.Tensor],
        outside: dict[int, Outside],
        forward: bool,
        earlier: dict[int, Made] | None = None,
        made_outside: list[torch.Tensor] | None = None,
        viewed: dict[Any, tuple[int, int]] | None = None,
    ) -> None:
        self.made: dict[int, Made] = {}
        # A recompute's: what the forward made (a tensor it cached, still alive, is that).
        self.earlier = earlier or {}
        # Tensors standing for others: values saved-tensor hooks hand back, private
        # copies of module buffers. id -> (ref, what they stand for, version offset).
        self.aliases: dict[int, tuple[weakref.ref[torch.Tensor], tuple[Any, ...], int]] = {}
        self.inputs = {id(t): (i, t._version) for i, t in enumerate(inputs)}
        # Tensors from outside, shared by a forward and its recomputes: by identity (checked),
        # each numbered in the order the forward first read it, with its version and
        # ``requires_grad`` then (an ``autograd.Function`` sets its outputs' later). So
        # signatures do not change from call to call (a program's, `Program`) as parameters
        # step, or `functional_call` passes others.
        self.outside = outside
        self.count = 0  # (a forward's) tensors from outside numbered so far
        self.forward = forward
        # A forward's: the tensors from outside it read, held until it ends (`transients`).
        self.held: list[torch.Tensor] = []
        # A recompute's: the forward's tensors made outside aten, and the numbers of those
        # its twins stand for (`_twin`).
        self.made_outside = made_outside or []
        self.twins: set[int] = set()
        # The views among the tensors from outside (`view_key`): their numbers and
        # versions when the forward first read them, for `Replayer._as_read`.
        self.viewed = {} if viewed is None else viewed
        # Made tensors by storage and layout, kept once a tensor subclass that re-wraps
        # outputs is met (an input, or at the first op that reads one, in both runs: one
        # from outside is described by its entry in the recompute, not `_aliased`): its
        # `as_subclass` alias outlives the op output it aliases.
        # key -> (storage ref, descriptor prefix, version offset).
        self.shared: dict[Any, tuple[weakref.ref[Any], tuple[Any, ...], int]] | None = (
            {} if any(map(_torch_private.rewraps_outputs, inputs)) else None
        )

    def describe(self, t: torch.Tensor, reads: set[int] | None = None) -> Any:
        made = self.made.get(id(t))
        if made is not None and made.ref() is t:
            if reads is not None:
                reads.add(made.op)
            return (made.op, made.position, t._version - made.made_at)
        alias = self.aliases.get(id(t)) if self.aliases else None
        if alias is not None and alias[0]() is t:
            if reads is not None and isinstance(alias[1][0], int):
                reads.add(alias[1][0])  # it stands for that op's output
            return (*alias[1], t._version + alias[2])
        position = self.inputs.get(id(t))
        if position is not None:
            return ("input", position[0], t._version - position[1])
        made = self.earlier.get(id(t))
        if made is not None and made.ref() is t:
            return (made.op, made.position, t._version - made.made_at)
        entry = self.outside.get(id(t))
        if entry is None or entry[0]() is not t:
            if t.grad_fn is not None or _torch_private.rewraps_outputs(t):
                shared = self._aliased(t)
                if shared is not None:
                    if reads is not None:
                        reads.add(shared[0])
                    return shared
            if not self.forward:
                return self._twin(t)
            entry = self.outside[id(t)] = (weakref.ref(t), self.count, t._version, t.requires_grad)
            self.count += 1
            self.held.append(t)
            if t._base is not None and type(t) is torch.Tensor:
                key = view_key(t)
                if key is not None:
                    self.viewed.setdefault(key, (entry[1], entry[2]))
        return ("outside", entry[1], t._version - entry[2])

    def transients(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """End of a forward: the tensors from outside it read that nothing but the region's
        ``outputs`` holds now, and the wrapper subclasses (``__torch_dispatch__``) among them,
        which C++ may hold too: no count tells whether only remat holds them.

        Made in the region outside aten (``torch.from_numpy`` of a value's ``.numpy()``,
        ``TwoTensor(h, h)``): kept alive, so that the recompute can check its twins against
        them (`_twin`).
        """
        held, self.held = self.held, []
        returned = {id(t) for t in outputs}
        return [
            held[i]
            for i in range(len(held))
            # References: the list's, and the call's argument (fewer where it is borrowed).
            if (
                sys.getrefcount(held[i]) <= 2
                or id(held[i]) in returned
                or (type(held[i]) not in _PLAIN and _torch_private.is_wrapper_subclass(held[i]))
            )
            and not held[i]._is_zerotensor()  # forward-mode AD's: no values to compare
        ]

    def _twin(self, t: torch.Tensor) -> Any:
        """A recompute's tensor that no op made and the forward never read: the forward's
        tensor made outside aten (`made_outside`) that it equals (type, layout, autograd,
        values), still as the forward first read it, if one is not matched yet; else a
        descriptor equal to nothing the forward recorded."""
        for original in self.made_outside:
            _, number, version, requires_grad = self.outside[id(original)]
            if (
                number not in self.twins
                and original._version == version
                and type(t) is type(original)
                and t.device == original.device
                and t.requires_grad == requires_grad
                and t.layout == original.layout == torch.strided
                and not t._is_zerotensor()
                and _geometry(t) == _geometry(original)
                and torch.equal(t, original)
            ):
                self.twins.add(number)
                self.alias(t, ("outside", number, 0))
                return ("outside", number, 0)
        return ("unknown", id(t))

    def signature(self, op: Op, args: Any, kwargs: Any, reads: set[int] | None) -> Any:
        """The op and its arguments, tensors replaced by where they came from."""
        keys: list[Any] = []
        made = self.made
        for arg in args:  # `_key` and `describe`, unrolled for the usual arguments (per op)
            kind = type(arg)
            if kind is torch.Tensor:
                version: int = arg._version
                entry = made.get(id(arg))
                if entry is not None and entry[0]() is arg:  # made by an op of this run
                    if reads is not None:
                        reads.add(entry[1])
                    keys.append((entry[1], entry[2], version - entry[3]))
                else:
                    keys.append(self.describe(arg, reads))
            elif kind in _SELF_DESCRIBING:
                keys.append(arg)
            elif kind is _PARAMETER:
                keys.append(self.describe(arg, reads))
            elif kind is float:
                keys.append(arg if arg == arg else "nan")
            elif kind is list:  # sizes, dims: the usual
                if _SELF_DESCRIBING.issuperset(map(type, arg)):
                    keys.append(tuple(arg))
                else:
                    keys.append(self._key(arg, reads))
            else:
                keys.append(self._key(arg, reads))
        if kwargs and op.random and "generator" in kwargs:
            # Which generator draws is the RNG replay's to check: a nested region's forward
            # draws on a private one (`RngCapture.call`), inside a recompute on none.
            kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        return (op, tuple(keys), self._key(kwargs, reads) if kwargs else ())

    def _key(self, value: Any, reads: set[int] | None) -> Any:
        kind = type(value)
        if kind in _SELF_DESCRIBING:  # most arguments: cheapest test first
            return value
        if isinstance(value, torch.Tensor):
            if self.shared is None and _torch_private.rewraps_outputs(value):
                self.shared = {}
            return self.describe(value, reads)
        if isinstance(value, (list, tuple)):
            for v in value:
                if type(v) not in _SELF_DESCRIBING:
                    return tuple([self._key(v, reads) for v in value])
            return tuple(value)  # sizes, dims: the usual
        if isinstance(value, dict):
            return tuple((k, self._key(v, reads)) for k, v in value.items())
        if kind is torch.Generator:  # isinstance goes through a slow metaclass
            # A dispatch mode sees a new wrapper of the same generator each time.
            return ("generator", value.device, value.initial_seed())
        if kind is torch.UntypedStorage:  # ``set_`` onto a tensor's memory
            return self._storage(value, reads)
        if isinstance(value, float) and value != value:
            return "nan"
        return value

    def _storage(self, storage: Any, reads: set[int] | None) -> Any:
        """A storage argument, as the first tensor made here whose storage it is, the op
        that made the memory (each run makes storages of its own); else itself (an
        input's, or one from outside). Read before the op runs, in both runs: ``set_``'s
        own target shows the storage once it ran."""
        for made in self.made.values():
            m = made.ref()
            if m is not None and m.layout == torch.strided and m.untyped_storage() is storage:
                if reads is not None:
                    reads.add(made.op)
                return ("storage", made.op, made.position)
        return storage

    def alias(self, t: torch.Tensor, descriptor: Any) -> None:
        """``t`` stands for the value ``descriptor`` describes (at ``t``'s version now)."""
        if isinstance(descriptor, tuple):
            *prefix, version = descriptor
            self.aliases[id(t)] = (weakref.ref(t), tuple(prefix), version - t._version)

    def record(self, op: Op, args: Any, out: Any, index: int) -> None:
        if op.view and _passes_through(op, args, out):
            self.alias(out, self.describe(args[0]))
            return
        if type(out) is torch.Tensor and self.shared is None:  # the usual: one plain output
            self.made[id(out)] = tuple.__new__(Made, (weakref.ref(out), index, 0, out._version))
            return
        for position, t in enumerate(output_tensors(out)):
            self.made[id(t)] = tuple.__new__(Made, (weakref.ref(t), index, position, t._version))
            if self.shared is not None and t.layout == torch.strided:
                storage = t.untyped_storage()
                entry = (weakref.ref(storage), (index, position), -t._version)
                self.shared[(id(storage), *_geometry(t))] = entry

    def _aliased(self, t: torch.Tensor) -> Any:
        """The made tensor ``t`` aliases with the same layout, if any, as described.

        An alias made where no dispatch mode sees it (a subclass's `as_subclass`, an
        autograd.Function returning its input, as FSDP2's post-backward hook does)
        holds the same values as what it aliases. Looked for only for tensors with
        autograd history or of such subclasses: by storage once a subclass is met,
        else among the made tensors still alive, newest first.
        """
        if t.layout != torch.strided:
            return None
        storage = t.untyped_storage()
        if self.shared is not None or _torch_private.rewraps_outputs(t):
            if self.shared is None:  # from now on: earlier outputs may be gone already
                self.shared = {}
            entry = self.shared.get((id(storage), *_geometry(t)))
            if entry is None or entry[0]() is not storage:
                return None
            return (*entry[1], t._version + entry[2])
        geometry = _geometry(t)
        for made in reversed(self.made.values()):
            m = made.ref()
            if (
                m is not None
                and m.layout == torch.strided
                and m.untyped_storage() is storage
                and _geometry(m) == geometry
            ):
                found = (made.op, made.position, t._version - made.made_at)
                self.alias(t, found)
                return found
        return None


def view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What a view ``t`` reads of its base's memory: the base, the memory, and how (None
    for a tensor with no storage or shape: a torch.func wrapper, a nested tensor)."""
    try:
        return (id(t._base), t.untyped_storage().data_ptr(), *_geometry(t))
    except (RuntimeError, NotImplementedError):
        return None


def unwrapped(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_torch_private.unwrap_all(t) for t in tensors]


def saved_as(t: torch.Tensor) -> tuple[Any, ...]:
    """How autograd saw a saved value: its logical shape, and its torch.func wrappers.

    Under vmap two saved values may share a batched tensor; under nested grad levels
    one value is saved at several levels. Level numbers change when a recompute
    re-creates levels, so only the wrappers' kinds count.
    """
    try:
        shape: Any = t.shape
    except RuntimeError:  # a strided nested tensor: its parts' shapes
        shape = ("nested", *map(tuple, t._nested_tensor_size().tolist()))
    chain = _torch_private.wrapper_chain(t)
    if not chain:
        return shape, ()
    return shape, tuple((bdim, requires_grad) for _, bdim, requires_grad in chain)


def saved_value(descriptor: Any, t: torch.Tensor) -> Any:
    """A saved value's signature: its descriptor, then its logical shape and torch.func
    wrappers (under vmap, two saved values may share their batched tensor). One flat tuple;
    for a value that an op made, ``(op, position, version, shape, ())``."""
    signature = (*descriptor, *saved_as(t))
    try:
        hash(signature)
    except TypeError:
        return object()  # matches nothing
    return signature


def arg_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an op argument (a tensor, or a list of them)."""
    values = value if isinstance(value, (list, tuple)) else (value,)
    return [t for t in values if isinstance(t, torch.Tensor)]


# Batch norm kernels that update the running statistics (arguments 3 and 4) in training
# (argument 5), which their schemas do not declare (nor does autograd count a version).
_UNDECLARED_WRITES = _modules.BATCH_NORM_OPS


def written(op: Op, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors an op writes in place, by its schema (and `_UNDECLARED_WRITES`)."""
    if op.func in _UNDECLARED_WRITES:
        return arg_tensors(list(args[3:5])) if args[5] else []
    written: list[torch.Tensor] = []
    for i, name in op.written:
        written += arg_tensors(args[i] if i < len(args) else kwargs.get(name))
    return written

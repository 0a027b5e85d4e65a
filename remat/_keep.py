"""Per-op policies: what the forward keeps, and the recompute's verified replay.

Forward (`Keeper`): every aten op of the region gets an index and a signature: the
op, its non-tensor arguments, and for each tensor argument where it came from (an
earlier op's output at some in-place version, a region input by position, or a
tensor from outside by identity). The policy decides for each op's outputs (random,
in-place and view ops always run; `memory_budget` may keep the end of an in-place
chain, `Keeper._chains`). When the forward ends, the ops the recompute
needs are found backwards from the values autograd saved, stopping at kept ops:
those kept values are held, every other one is released, and unneeded ops are
marked to be skipped.

Recompute (`Replayer`): each op is matched to the first unmatched forward op with
the same signature. Equal signatures compute equal values, so only a matched op is
replayed from a kept value or skipped; an unmatched op runs for real, and after an
unmatched op that writes in place nothing more is matched. A skipped op returns
``meta`` tensors, which hold no data: reading one outside aten (``.tolist()``,
``.numpy()``) fails, as does any op that really runs on one, and the recompute then
starts again without skipping (`Restart`). A random op that is replayed or skipped
still leaves the next random op the forward's numbers (`Replayer._pass`).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _budget, _modules, _torch_private
from ._policies import Decision, OpCall, Policy, as_decision
from ._rng import is_random

__all__ = ["DIVERGED", "Keeper", "Op", "Program", "Replayer", "Restart", "op_info", "written"]


class Restart(BaseException):
    """A recompute read a value it skipped: run it again without skipping."""


def _outputs(out: Any) -> list[torch.Tensor]:
    values = out if isinstance(out, (list, tuple)) else (out,)
    return [t for t in values if isinstance(t, torch.Tensor)]


def _map(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (list, tuple)):
        return type(out)(fn(t) if isinstance(t, torch.Tensor) else t for t in out)
    return out


def storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Which memory ``t`` shows (equal keys: equal views of the same data), if it has any.

    Forward-mode AD makes zero tangents with no storage at all, and a wrapper subclass
    (a ``__torch_dispatch__`` one: DTensor, TwoTensor) keeps its data in tensors it holds.
    """
    memory = None if t._is_zerotensor() else _memory(t)
    if memory is None:
        return None
    return (memory, t.storage_offset(), t.shape, t.stride(), t.dtype)


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

_READS_METADATA, _ALWAYS_RUNS, _VIEW, _DECIDED = range(4)


class Op:
    """What the bookkeeping needs to know of an op overload, found once (`op_info`).

    Signatures and tables hold these rather than the overloads, which hash in Python.
    """

    __slots__ = ("func", "kind", "mutable", "random", "transparent", "view", "writes", "written")

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
        # Its output is its input's value: provenance passes through it (autograd adds
        # and drops detaches between one run and the next).
        self.transparent = func in (aten.detach.default, aten.alias.default)
        if func.overloadpacket in _METADATA_ONLY:
            self.kind = _READS_METADATA
        elif self.random or self.mutable:
            self.kind = _ALWAYS_RUNS
        else:
            self.kind = _VIEW if self.view else _DECIDED


_OPS: dict[int, Op] = {}


def op_info(func: Any) -> Op:
    op = _OPS.get(id(func))
    if op is None:
        op = _OPS[id(func)] = Op(func)
    return op


def _passes_through(op: Op, args: Any, out: Any) -> bool:
    """Whether ``out`` is ``args[0]`` as it is: a detach, an alias, or a view that changes
    nothing (autograd makes one for an autograd.Function that returns its input, as
    FSDP2's post-backward hook does, and only when the hook runs)."""
    if not op.view or not isinstance(out, torch.Tensor):
        return False
    if op.transparent:
        return True
    if not args or not isinstance(args[0], torch.Tensor) or out.shape != args[0].shape:
        return False
    return _geometry(out) == _geometry(args[0])


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    """Where in its storage a tensor's values lie, and how they are read."""
    return (t.storage_offset(), t.shape, t.stride(), t.dtype)


def _memory(t: torch.Tensor) -> int | None:
    """Where ``t``'s data starts (`storage_key`'s first part); None where it has no storage."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other layouts
        return None


def _version(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out._version
    return sum(t._version for t in _outputs(out))


# Argument types that stand for themselves in a signature.
_SELF_DESCRIBING = frozenset(
    {int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)
_PARAMETER = torch.nn.Parameter
_PLAIN = (torch.Tensor, _PARAMETER)


class _Made(NamedTuple):
    """A tensor an op of the region made: which op, which output, at which version."""

    ref: weakref.ref[torch.Tensor]
    op: int
    position: int
    made_at: int


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
    )

    def __init__(
        self,
        inputs: list[torch.Tensor],
        outside: dict[int, tuple[weakref.ref[torch.Tensor], int, int]],
        forward: bool,
        earlier: dict[int, _Made] | None = None,
        made_outside: list[torch.Tensor] | None = None,
    ) -> None:
        self.made: dict[int, _Made] = {}
        # A recompute's: what the forward made (a tensor it cached, still alive, is that).
        self.earlier = earlier or {}
        # Tensors standing for others: values saved-tensor hooks hand back, private
        # copies of module buffers. id -> (ref, what they stand for, version offset).
        self.aliases: dict[int, tuple[weakref.ref[torch.Tensor], tuple[Any, ...], int]] = {}
        self.inputs = {id(t): (i, t._version) for i, t in enumerate(inputs)}
        # Tensors from outside, shared by a forward and its recomputes: by identity (checked),
        # each numbered in the order the forward first read it, with its version then. So
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
        # Made tensors by storage and layout, kept once a tensor subclass that re-wraps
        # outputs is met: its `as_subclass` alias outlives the op output it aliases.
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
            entry = self.outside[id(t)] = (weakref.ref(t), self.count, t._version)
            self.count += 1
            self.held.append(t)
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
            _, number, version = self.outside[id(original)]
            if (
                number not in self.twins
                and original._version == version
                and type(t) is type(original)
                and t.device == original.device
                and t.requires_grad == original.requires_grad
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
        return (op, tuple(keys), self._key(kwargs, reads) if kwargs else ())

    def _key(self, value: Any, reads: set[int] | None) -> Any:
        kind = type(value)
        if kind in _SELF_DESCRIBING:  # most arguments: cheapest test first
            return value
        if isinstance(value, torch.Tensor):
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
        if isinstance(value, float) and value != value:
            return "nan"
        return value

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
            self.made[id(out)] = tuple.__new__(_Made, (weakref.ref(out), index, 0, out._version))
            return
        for position, t in enumerate(_outputs(out)):
            self.made[id(t)] = tuple.__new__(_Made, (weakref.ref(t), index, position, t._version))
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


class _Shape(NamedTuple):
    """An op output's layout, to stand in for it (as a meta tensor) when it is skipped."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return cls(out.shape, out.stride(), out.dtype, out.device)
        if isinstance(out, (list, tuple)) and out and all(isinstance(t, torch.Tensor) for t in out):
            return type(out)(map(cls.of, out))
        return None


DIVERGED = object()  # `Keeper.follow`: the op is not the program's next one
_MAX_PROGRAMS = 16  # per owner and training mode


class Program:
    """The ops one forward of a region ran: what its later forwards follow (`Keeper.follow`).

    Kept per region owner and training mode (`_modules.programs`), by policy and input
    layouts. A following forward checks each op's signature against the program's and
    keeps what the program's forward kept, instead of recording the op; the first op that
    differs ends the following, and the forward records from there on.
    """

    __slots__ = (
        "decisions",
        "deps",
        "layouts",
        "needs",
        "ops",
        "plan",
        "roots",
        "sigs",
        "steps",
        "table",
    )

    def __init__(self, keeper: Keeper) -> None:
        self.ops, self.sigs = tuple(keeper.ops), tuple(keeper.sigs)
        self.deps, self.layouts = tuple(keeper.deps), tuple(keeper.layouts)
        self.roots, self.steps = tuple(keeper.roots), dict(keeper.steps)
        self.table = keeper.table
        self.decisions = dict(keeper.decisions)
        self.plan = keeper.plan  # `memory_budget`'s
        # What its forwards' recomputes run (`Keeper._needed`), by the values they rebuild
        # and keep: the same for each forward that saves and keeps the same ones.
        self.needs: dict[Any, tuple[frozenset[int], dict[int, Any]]] = {}


class Keeper:
    """The forward side: signatures, the policy's decisions, and what the recompute needs."""

    __slots__ = (
        "budget",
        "chained",
        "chains",
        "costs",
        "count",
        "decided",
        "decisions",
        "deps",
        "described",
        "error",
        "finished",
        "kept",
        "key",
        "keys",
        "layouts",
        "made",
        "made_outside",
        "offload",
        "ops",
        "outside",
        "plan",
        "policy",
        "program",
        "programs",
        "provenance",
        "rebuilt_before",
        "roots",
        "saved_bytes",
        "sigs",
        "skip",
        "skips",
        "sources",
        "steps",
        "table",
        "tags",
        "wanted",
    )

    def __init__(
        self,
        policy: Policy,
        inputs: list[torch.Tensor],
        sources: bool,
        owner: Any,
        reach: tuple[int, ...],
    ) -> None:
        self.policy = policy
        # op -> the policy's decision, for a policy that decides by the op alone
        self.decided: dict[Any, Decision] | None = {} if policy.by_op else None
        self.ops: Any = []  # op index -> the aten op (a program's tuple, while following it)
        self.count = 0  # ops the forward ran so far
        self.sigs: Any = []  # op index -> its signature
        self.decisions: dict[int, Decision] = {}  # op index -> the policy's, when it keeps
        self.deps: Any = []  # op index -> indices of the ops it read
        self.layouts: Any = []  # op index -> output layouts, for placeholders
        self.roots: Any = []  # ops that always run in the recompute
        # `memory_budget`: in-place steps (op index -> the op whose output it writes), and
        # once the forward finished, the chains they form (`_chains`).
        self.steps: dict[int, int] = {}
        self.chains: dict[int, tuple[int, ...]] = {}  # last step -> the chain's ops
        self.chained: dict[int, int] = {}  # op index -> its kept chain's last step
        self.table: dict[Any, list[int]] = {}  # signature -> op indices, in order
        self.outside: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self.made_outside: list[torch.Tensor] = []  # once the forward finished
        self.provenance: Provenance | None = Provenance(_plain(inputs), self.outside, forward=True)
        self.made: dict[int, _Made] = {}  # the forward's, once it finished
        self.described: list[Any] = []  # handle index -> the saved value's signature
        self.kept: dict[int, tuple[Any, int]] = {}  # op index -> (output, version)
        self.keys: dict[tuple[Any, ...], int] = {}  # storage key of a kept output -> index
        self.wanted: set[int] = set()  # ops whose outputs autograd saved for a rebuild
        self.skip: dict[int, Any] = {}  # op index -> layout, once the forward finished
        self.tags: dict[int, frozenset[str]] = {}
        self.offload: dict[int, tuple[torch.device, torch.device]] = {}
        self.sources: dict[int, str] | None = {} if sources else None
        self.error: Exception | None = None
        self.rebuilt_before = 0
        self.skips = True
        self.finished = False
        # `memory_budget`: its plan for this region's signature, or (while it has none)
        # each op's estimated cost and the storages autograd saves (ptr -> bytes).
        self.budget = policy.budget
        self.plan: _budget.Plan | None = None
        self.costs: list[float] | None = None
        self.saved_bytes: dict[int, int] = {}
        # The program this region's earlier forwards ran (same owner, training mode, policy,
        # input layouts and modules reached: closures of one code over other modules run
        # other programs), followed op by op while it fits (`follow`). A policy that looks
        # at more than the op (a callable, names) records every forward.
        self.key = (policy, tuple(map(_layout, inputs)), reach)
        self.programs = _modules.programs(owner) if policy.by_op else None
        self.program: Program | None = None
        if self.programs is not None:
            self.program = self.programs.get(self.key)
            if self.program is not None:
                self.ops, self.steps = self.program.ops, self.program.steps
        if self.budget is not None:
            self.plan = self.program.plan if self.program is not None else None
            self.costs = [] if self.plan is None else None

    def after(self, op: Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Record one forward op: its signature, and the policy's decision on its outputs."""
        provenance = self.provenance
        assert provenance is not None
        index = self.count
        self.count = index + 1
        func = op.func
        self.ops.append(func)
        kind = op.kind
        reads: set[int] = set()
        signature = provenance.signature(op, args, kwargs, reads)
        self.sigs.append(signature)
        self.deps.append(() if kind == _READS_METADATA else tuple(reads))
        try:  # noqa: SIM105 - `suppress` costs a context manager per op
            self.table.setdefault(signature, []).append(index)
        except TypeError:  # an unhashable argument: never matched
            pass
        step = self.budget is not None and kind == _ALWAYS_RUNS and self._step(op, args, out)
        provenance.record(op, args, out, index)
        if type(out) is torch.Tensor:  # `_Shape.of`, for the usual output
            layout = tuple.__new__(_Shape, (out.shape, out.stride(), out.dtype, out.device))
        else:
            layout = _Shape.of(out)
        self.layouts.append(layout)
        decided = (kind in (_DECIDED, _READS_METADATA) or step) and layout is not None
        if self.budget is not None:
            decided = self._budgeted(index, op, args, kwargs, out, decided)
        if kind == _ALWAYS_RUNS or layout is None:
            self.roots.append(index)
            if not (step and decided):
                return
        if not decided:
            return
        decision = self.decided.get(op) if self.decided is not None else None
        if decision is None:
            try:
                decision = self.policy.decide(func, lambda: OpCall(func, args, kwargs, out))
            except TypeError as error:  # raised when the forward ends: an operator would mask it
                self.error = self.error or error
                return
            if self.decided is not None:
                self.decided[op] = decision
        if decision is not Decision.RECOMPUTE:
            self.decisions[index] = decision
            self._apply(index, decision, out)

    def follow(self, op: Op, args: Any, kwargs: Any, run: _Run) -> Any:
        """Run the next op of the forward if it is the program's next one (same signature),
        keeping its outputs as the program's forward did; else stop following (`_diverge`)
        and return `DIVERGED`: the caller records the op as a first forward does."""
        program, provenance = self.program, self.provenance
        assert program is not None
        assert provenance is not None
        index = self.count
        try:  # (a signature starts with its op: the op is compared first)
            same = provenance.signature(op, args, kwargs, None) == program.sigs[index]
        except Exception:  # past the program's end, or an argument whose ``==`` raises (a
            same = False  # process group): not the same
        if not same:
            self._diverge()
            return DIVERGED
        out = run(op, args, kwargs) if op.random else op.func(*args, **kwargs)
        self.count = index + 1
        if type(out) is torch.Tensor and provenance.shared is None and not op.view:
            provenance.made[id(out)] = tuple.__new__(
                _Made, (weakref.ref(out), index, 0, out._version)
            )  # `Provenance.record`, for the usual op
        else:
            provenance.record(op, args, out, index)
        decision = program.decisions.get(index)
        if decision is not None:
            self.decisions[index] = decision
            self._apply(index, decision, out)
        return out

    def _diverge(self) -> None:
        """The forward leaves its program at op `count`: from there it records every op, as
        a first forward does, on the program's records of the ops before (those it ran)."""
        program, count = self.program, self.count
        assert program is not None
        self.program = None
        self.ops, self.sigs = list(program.ops[:count]), list(program.sigs[:count])
        self.deps, self.layouts = list(program.deps[:count]), list(program.layouts[:count])
        self.roots = [r for r in program.roots if r < count]
        self.steps = {k: v for k, v in program.steps.items() if k < count}
        self.table = {}
        for index, signature in enumerate(self.sigs):
            with contextlib.suppress(TypeError):  # an unhashable argument: never matched
                self.table.setdefault(signature, []).append(index)
        if self.budget is not None:
            self._abandon()

    def _step(self, op: Op, args: Any, out: Any) -> bool:
        """Whether op ``op`` (it just ran) writes only its first argument, in place, once,
        and that argument is an op's output as that op left it, or as a step left it:
        noted in `steps`. (Dropout's mask is ``empty_like``, ``bernoulli_``, ``div_``.)"""
        target = args[0] if args else None
        if out is not target or not op.mutable or not isinstance(target, torch.Tensor):
            return False
        made = self.provenance.made.get(id(target)) if self.provenance is not None else None
        if made is None or made.ref() is not target:
            return False
        # Versions go up once an in-place op returns: a step's own count from then.
        if target._version - made.made_at != (made.op in self.steps):
            return False
        if any(t is not target for t in written(op, args, {})):
            return False
        self.steps[self.count - 1] = made.op
        return True

    def _budgeted(
        self, index: int, op: Op, args: Any, kwargs: Any, out: Any, decided: bool
    ) -> bool:
        """Whether `memory_budget` may keep op ``index``: while it plans, any op it may
        choose (its cost is noted); then the ops its plan keeps, while the forward runs
        the planned ops (one that does not keeps nothing, and the next call plans again).
        """
        if self.costs is not None:
            self.costs.append(self._cost(OpCall(op.func, args, kwargs, out)) if decided else 0.0)
            # Not what a ``*_like`` factory made from a tensor that needs grad: autograd
            # detaches such an output if something else holds it when the op returns, so
            # keeping it here adds an op that the planned forwards lack.
            return decided and op.kind != _READS_METADATA
        return False  # a forward that left the planned one keeps nothing (`_abandon`)

    def _abandon(self) -> None:
        """The forward is not the one planned: keep nothing, and plan on the next call."""
        if self.programs is not None:
            self.programs.pop(self.key, None)
        self.plan = None
        self.kept.clear()
        self.offload.clear()
        self.decisions.clear()

    def _cost(self, call: OpCall) -> float:
        assert self.budget is not None
        estimate = self.budget.cost or _budget.estimated_cost
        value = estimate(call)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            self.error = self.error or TypeError(
                f"`memory_budget`: `cost` must return a number >= 0, but {estimate!r} "
                f"returned {value!r} for {call.op}."
            )
            return 0.0
        return float(value)

    def tag(self, t: torch.Tensor, names: frozenset[str]) -> None:
        """`remat.name`: ask the policy again about the op that produced ``t``."""
        made = self.provenance.made.get(id(t)) if self.provenance is not None else None
        if made is None or made.ref() is not t:
            return
        index = made.op
        names = self.tags.get(index, frozenset()) | names
        self.tags[index] = names
        if self.budget is not None:  # the budget decides by cost, whatever the names
            return
        func = self.ops[index]
        decision = as_decision(self.policy, self.policy(OpCall(func, (), {}, t, names)), func)
        self.kept.pop(index, None)
        self.offload.pop(index, None)
        if (
            index not in self.roots
            and op_info(func).kind == _DECIDED
            and decision is not Decision.RECOMPUTE
        ):
            self._apply(index, decision, t)

    def _apply(self, index: int, decision: Decision, out: Any) -> None:
        # An in-place step's write counts once it returns.
        self.kept[index] = (out, _version(out) + (index in self.steps))
        for t in _outputs(out):
            key = storage_key(t)
            if key is not None:
                self.keys[key] = index
        if decision is Decision.OFFLOAD:
            target = self.policy.device or torch.device("cpu")
            self.offload[index] = (_outputs(out)[0].device, target)
        if self.sources is not None:
            from ._errors import source_line

            self.sources[index] = source_line()

    def note_saved(self, t: torch.Tensor) -> None:
        """Autograd saves ``t`` for the next handle: the recompute runs up to here and
        rebuilds it."""
        assert self.provenance is not None
        self.rebuilt_before = self.count
        made = self.provenance.made.get(id(t))
        index: int | None
        if made is not None and made[0]() is t:  # an op's output (so no torch.func wrapper)
            index = made[1]
            # One flat tuple, `_saved_value`'s: it lives until the backward.
            self.described.append((index, made[2], t._version - made[3], t.shape, ()))
        else:
            plain = _torch_private.unwrap_all(t)
            descriptor = self.provenance.describe(plain)  # the op that made it, or its alias
            index = descriptor[0] if isinstance(descriptor[0], int) else None
            if index is None and self.keys:
                index = self.keys.get(storage_key(plain))  # type: ignore[arg-type]
            self.described.append(_saved_value(descriptor, t))
        if index is not None:
            self.wanted.add(index)
            if self.costs is not None:
                self._note_bytes(_torch_private.unwrap_all(t), index)

    def _note_bytes(self, t: torch.Tensor, index: int) -> None:
        """While `memory_budget` plans: the bytes of a saved value's storage, if made here."""
        key = storage_key(t)
        if key is not None and op_info(self.ops[self._base(index)]).kind != _VIEW:
            self.saved_bytes[key[0]] = t.untyped_storage().nbytes()

    def handed_back(self, handle: int, value: torch.Tensor) -> None:
        """A recompute inside the forward gave ``fn`` the value of ``handle``."""
        key = self.described[handle]
        if self.provenance is not None and isinstance(key, tuple):
            self.provenance.alias(_torch_private.unwrap_all(value), key[:-2])

    def outside_tensors(self) -> list[torch.Tensor]:
        """The tensors from outside the region that the forward read, still alive."""
        return [t for t in (entry[0]() for entry in self.outside.values()) if t is not None]

    def finish(self, outputs: list[torch.Tensor], skip: bool = True) -> None:
        """End of forward: hold what the recompute reads, skip what it does not need.

        ``outputs``: the region's (`memory_budget` leaves them to the caller).
        ``skip=False`` (when a torch.func level records the recompute, see
        `Levels.records_recompute`) runs every op again except kept ones that are needed.
        """
        if self.error is not None:
            raise self.error
        program = self.program
        if program is not None:
            if self.count == len(program.ops):  # it ran the program to its end: adopt it
                self.sigs, self.deps, self.layouts = program.sigs, program.deps, program.layouts
                self.roots, self.steps, self.table = program.roots, program.steps, program.table
            else:
                self._diverge()
        self.skips = self.skips and skip
        self.chains = self._chains() if self.steps else {}
        if self.costs is not None:
            self._choose(outputs)
        elif self.plan is not None and (
            self.count != self.plan.ops or self.wanted != self.plan.wanted
        ):
            self._abandon()  # autograd saved other values: the plan's bound may not hold
        if (
            self.program is None
            and self.programs is not None
            and not (self.budget is not None and self.plan is None)
        ):
            if len(self.programs) >= _MAX_PROGRAMS:  # an owner run on ever new layouts
                self.programs.clear()
            self.program = self.programs[self.key] = Program(self)
        self.chained = {
            member: end for end in self.kept if end in self.chains for member in self.chains[end]
        }
        needed, skippable = self._needed()
        with _torch_private.functorch_cleared():
            for index in list(self.kept):
                out, version = self.kept.pop(index)
                if index in needed and _version(out) == version:
                    alias = _map(out, torch.Tensor.detach)  # shares out's version counter
                    if index in self.offload:
                        alias = _move(alias, self.offload[index][1])
                    self.kept[index] = (alias, _version(alias))
        if self.skips:
            self.skip = skippable
        # The outputs still alive (the region's, values it cached) for the recompute to
        # find (`Provenance.earlier`); not the dead ones' records, which would live as long
        # as the graph, for the garbage collector to go through.
        made = self.provenance.made  # type: ignore[union-attr]
        self.made = {key: entry for key, entry in made.items() if entry[0]() is not None}
        self.made_outside = self.provenance.transients(outputs)  # type: ignore[union-attr]
        self.provenance, self.keys, self.finished = None, {}, True

    def _choose(self, outputs: list[torch.Tensor]) -> None:
        """`memory_budget`'s first forward of a program: choose what to keep, and plan.

        The region's outputs are the caller's: plain autograd's bytes for the region leave
        them out (the next layer holds them, as its input), and so do the candidates.
        """
        assert self.budget is not None
        assert self.costs is not None
        theirs = {_memory(_torch_private.unwrap_all(t)) for t in outputs}
        limit = self.rebuilt_before
        starts = [i for i in self.wanted if i < limit] + [r for r in self.roots if r < limit]
        candidates: dict[int, int] = {}
        for index in map(self._base, starts):
            if index in self.steps and index not in self.chains:
                continue
            entry = self.kept.get(index)
            if entry is not None and _version(entry[0]) == entry[1]:
                made = _outputs(entry[0])
                if not any(_memory(t) in theirs for t in made):
                    candidates[index] = sum(t.untyped_storage().nbytes() for t in made)
        theirs.discard(None)
        plain = sum(n for memory, n in self.saved_bytes.items() if memory not in theirs)
        order, why = _budget.choose(
            self.budget.fraction, candidates, plain, self.deps, self.costs, starts, self.chains
        )
        for index in set(self.kept) - set(order):
            self.kept.pop(index)
            self.offload.pop(index, None)
            self.decisions.pop(index, None)
        held = sum(candidates[i] for i in order)
        self.plan = _budget.Plan(
            self.count,
            frozenset(self.wanted),
            frozenset(order),
            why,
            plain,
            held,
        )
        self.costs = None

    def _chains(self) -> dict[int, tuple[int, ...]]:
        """In-place chains the recompute may take whole from the kept value of their last
        step: last step -> its ops. The first made the memory (one output, not a view),
        then each step writes it and only the next step reads it; autograd saved none of
        these values but the last."""
        readers = collections.Counter(d for deps in self.deps for d in deps)
        chains = {}
        for end in self.steps:
            members = [end]
            while members[-1] in self.steps:
                made = self.steps[members[-1]]
                if readers[made] != 1 or made in self.wanted:
                    break
                members.append(made)
            else:
                first = members[-1]
                if op_info(self.ops[first]).kind in (_DECIDED, _READS_METADATA) and isinstance(
                    self.layouts[first], _Shape
                ):
                    chains[end] = tuple(reversed(members))
        return chains

    def _base(self, index: int) -> int:
        """The op that made the memory op ``index``'s output views (a view is kept by
        keeping its base); a view op itself for a view of a region input."""
        while op_info(self.ops[index]).kind == _VIEW and self.deps[index]:
            index = self.deps[index][0]
        return index

    def reason(self, index: int) -> str:
        """Why `memory_budget` keeps op ``index``'s outputs, for `saved_residuals`."""
        plan = self.plan
        if plan is None or index not in plan.why:
            return ""
        return (
            f"; {self.budget!r} keeps it ({plan.why[index]}; the region holds {plan.held} "
            f"of the {plan.plain} bytes plain autograd holds for it, its outputs aside)"
        )

    def release(self) -> None:
        """After a recompute: drop every kept value, as nothing may read them again.

        Only a second backward through the same graph (``retain_graph=True``) could;
        it then runs those ops again, so the ops they read are no longer skipped.
        """
        if self.finished and self.kept:
            self.kept.clear()
            self.chained = {}
            if self.skips:
                self.skip = self._needed()[1]

    def stop_skipping(self) -> None:
        """A skipped value was read: from now on the recompute runs every op it reaches."""
        self.skips = False
        self.skip = {}

    def _needed(self) -> tuple[frozenset[int], dict[int, Any]]:
        """Ops the recompute must run: backwards from rebuilt values, stopping at kept ones;
        and those it may skip, with their layouts.

        Remembered by the program, for its forwards that rebuild and keep the same values.
        """
        limit = self.rebuilt_before
        needs = self.program.needs if self.program is not None else None
        if needs is not None:
            key = (limit, frozenset(self.wanted), frozenset(self.kept), frozenset(self.chained))
            found = needs.get(key)
            if found is not None:
                return found
        needed: set[int] = set()
        stack = [i for i in self.wanted if i < limit] + [r for r in self.roots if r < limit]
        while stack:
            index = stack.pop()
            if index in needed:
                continue
            needed.add(index)
            if index not in self.kept and index not in self.chained:
                stack.extend(self.deps[index])
        found = frozenset(needed), {i: self.layouts[i] for i in range(limit) if i not in needed}
        if needs is not None:
            if len(needs) >= _MAX_PROGRAMS:
                needs.clear()
            needs[key] = found
        return found

    def replayable(self, index: int) -> bool:
        """Whether a kept value still holds what its op computed.

        Inside the forward (a recompute started there) the forward may have
        modified it in place since; the op then runs again. After the forward,
        `value` raises on such a change.
        """
        out, version = self.kept[index]
        return self.finished or _version(out) == version

    def chain_value(self, end: int) -> torch.Tensor:
        """The kept value of chain ``end`` for its first op: memory of its own (the chain's
        steps bump a version counter, which this one does not share with the kept value)."""
        value = self.value(end)
        if end in self.offload:
            return value  # a copy already
        own = torch.empty((0,), dtype=value.dtype, device=value.device)
        return own.set_(
            value.untyped_storage(), value.storage_offset(), value.shape, value.stride()
        )

    def value(self, index: int) -> Any:
        """A kept value, on its own device, as a fresh alias autograd may attach to."""
        alias, version = self.kept[index]
        if _version(alias) != version:
            from ._errors import changed_since_forward

            raise changed_since_forward(
                f"a value the policy kept (output of {self.ops[index]})",
                version,
                _version(alias),
                "Clone it before modifying it.",
            )
        if index in self.offload:
            return _move(alias, self.offload[index][0])
        return _map(alias, torch.Tensor.detach)


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    """An input as a program's key sees it: layout, and its torch.func wrappers' kinds."""
    return t.dtype, t.device, t.requires_grad, *_saved_as(t)


def _plain(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_torch_private.unwrap_all(t) for t in tensors]


def _saved_as(t: torch.Tensor) -> tuple[Any, ...]:
    """How autograd saw a saved value: its logical shape, and its torch.func wrappers.

    Under vmap two saved values may share a batched tensor; under nested grad levels
    one value is saved at several levels. Level numbers change when a recompute
    re-creates levels, so only the wrappers' kinds count.
    """
    chain = _torch_private.wrapper_chain(t)
    if not chain:
        return t.shape, ()
    return t.shape, tuple((bdim, requires_grad) for _, bdim, requires_grad in chain)


def _saved_value(descriptor: Any, t: torch.Tensor) -> Any:
    """A saved value's signature: its descriptor, then its logical shape and torch.func
    wrappers (under vmap, two saved values may share their batched tensor). One flat tuple;
    for a value that an op made, ``(op, position, version, shape, ())``."""
    signature = (*descriptor, *_saved_as(t))
    try:
        hash(signature)
    except TypeError:
        return object()  # matches nothing
    return signature


# `OpMode`'s callbacks: run an op (random ones under RNG replay); leave a random op's draw
# out, if the replay can.
_Run = Callable[[Op, Any, Any], Any]
_Passed = Callable[[Op, Any, Any], bool]


class Replayer:
    """The recompute side: matches each op to the forward's, then replays, skips or runs it.

    It runs inside the recompute's dispatch mode, below torch.func's levels.
    """

    __slots__ = (
        "cursor",
        "diverged",
        "fresh",
        "handles",
        "keeper",
        "last",
        "placeholders",
        "provenance",
        "restart",
    )

    def __init__(self, keeper: Keeper, inputs: list[torch.Tensor]) -> None:
        if keeper.program is not None and not keeper.finished:  # inside a following forward
            keeper._diverge()  # its records so far, for the replay to match against
        self.keeper = keeper
        made = keeper.provenance.made if keeper.provenance is not None else keeper.made
        self.provenance = Provenance(
            _plain(inputs), keeper.outside, False, made, keeper.made_outside
        )
        self.cursor: dict[int, int] = {}  # id of the table's list of indices -> next
        # saved value's signature -> its handles, last first
        self.handles: dict[Any, list[int]] = {}
        for handle in reversed(range(len(keeper.described))):
            self.handles.setdefault(keeper.described[handle], []).append(handle)
        # id -> (the placeholder, kept alive so its id stays its own; the real device)
        self.placeholders: dict[int, tuple[torch.Tensor, torch.device]] = {}
        self.diverged = self.restart = False
        self.last: Any = None
        # Memory that unmatched ops made: no matched op reads it. id -> storage ref.
        self.fresh: dict[int, weakref.ref[Any]] = {}

    def call(self, op: Op, args: Any, kwargs: Any, run: _Run, passed: _Passed) -> Any:
        """One op of the recompute: its kept value, a placeholder, or what ``run`` returns.

        A step of a kept chain returns its argument, whose memory holds the chain's end
        already. A random op that does not run leaves its draw out (``passed``), or where
        that cannot be, draws into scratch memory (`_pass`).
        """
        signature = self.provenance.signature(op, args, kwargs, None)
        index = None if self.diverged else self._match(signature)
        if index is None and not self.diverged and self.placeholders and _device(kwargs) == _META:
            # A factory call on the device that a skipped value's ``.device`` reported
            # (a meta placeholder's): run it where the forward did, if that matches.
            real = {device for _, device in self.placeholders.values()}
            moved = {**kwargs, "device": real.pop()} if len(real) == 1 else kwargs
            again = self._match(self.provenance.signature(op, args, moved, None))
            if again is not None:
                index, kwargs = again, moved
        keeper = self.keeper
        if (
            index is not None
            and not self.placeholders
            and not op.random
            and index not in keeper.chained
            and index not in keeper.kept
            and index not in keeper.skip
        ):  # matched, and it runs: the usual op
            out = op.func(*args, **kwargs)
            self.provenance.record(op, args, out, index)
            return out
        end = keeper.chained.get(index) if index is not None else None
        if end is not None and end in keeper.kept and keeper.replayable(end):
            if index == keeper.chains[end][0]:
                out = keeper.chain_value(end)
            else:
                out = args[0]
                if op.random:
                    self._pass(op, args, kwargs, run, passed, in_place=True)
        elif (
            index is not None
            and index in keeper.kept
            and index not in keeper.steps  # an in-place step returns its argument
            and keeper.replayable(index)
        ):
            out = keeper.value(index)
            if op.random:  # rand_like and such: a policy may keep them
                self._pass(op, args, kwargs, run, passed)
        elif index is not None and index in keeper.skip and self._skippable(op, args):
            out = self._placeholder(keeper.skip[index])
            if op.random:
                self._pass(op, args, kwargs, run, passed)
        elif op.transparent and self.placeholders and self._reads_placeholder(args):
            # A detach the forward did not run, of a skipped value: autograd adds one after
            # a ``*_like`` op whose output something else holds, as a placeholder is.
            out = args[0].detach()
            self.placeholders[id(out)] = (out, self.placeholders[id(args[0])][1])
        else:
            if self.placeholders and self._reads_placeholder((args, kwargs)):
                if op.kind != _READS_METADATA:
                    self.restart = True
                    raise Restart
                args, kwargs = self._real_layouts((args, kwargs))
            out = run(op, args, kwargs)
            if self.placeholders and any(t.device.type == "meta" for t in _outputs(out)):
                self.restart = True  # a skipped value reached a real result some other way
                raise Restart
            if index is None:
                if not op.mutable:
                    self._made_fresh(op, args, out)
                elif not self._harmless(op, args, kwargs):
                    self.diverged = True  # an unknown write: aliases may now hold anything
        self.provenance.record(op, args, out, -1 if index is None else index)
        return out

    def _pass(
        self, op: Op, args: Any, kwargs: Any, run: _Run, passed: _Passed, in_place: bool = False
    ) -> None:
        """A random op the recompute does not run: leave its draw out (``passed``), or
        where the replay cannot, draw and drop the numbers (an in-place one into scratch
        memory, not its argument). Either way later random ops draw what the forward's
        did."""
        if self.placeholders:
            args, kwargs = self._real_layouts((args, kwargs))
        if not passed(op, args, kwargs):
            if in_place:
                args = (torch.empty_like(args[0]), *args[1:])
            run(op, args, kwargs)

    def _made_fresh(self, op: Op, args: Any, out: Any) -> None:
        """Note the memory an unmatched op allocated (not a view: no input's memory)."""
        if op.view:
            return
        inputs = [t for arg in args for t in _tensors(arg) if t.layout == torch.strided]
        read = {id(t.untyped_storage()) for t in inputs}
        for t in _outputs(out):
            if t.layout == torch.strided and id(t.untyped_storage()) not in read:
                storage = t.untyped_storage()
                self.fresh[id(storage)] = weakref.ref(storage)

    def _harmless(self, op: Op, args: Any, kwargs: Any) -> bool:
        """Whether an unmatched write leaves what matched ops read as the forward had it.

        It does if it writes only memory that unmatched ops of this recompute made, or
        if it is FSDP2 re-gathering parameters: its ``fsdp`` ops write the unsharded
        parameters from the shards, which hold what the forward read (FSDP2 keeps their
        version counters; updating the shards themselves raises, see `ModuleState`).
        FSDP2 gathers where its state says (in the forward, a prefetch, or the
        recompute), so one run may gather inside the region and the other not.
        """
        if op.func.namespace == "fsdp":
            return True
        for t in written(op, args, kwargs):
            if t.layout != torch.strided:
                return False
            storage = t.untyped_storage()
            ref = self.fresh.get(id(storage))
            if ref is None or ref() is not storage:
                return False
        return True

    def close(self) -> None:
        """End of the recompute: drop the placeholders.

        They carry the recompute's autograd history, whose saved values hold the pack
        hook, which holds this replayer: a cycle through C++ that Python's collector
        cannot see, which kept every block's recomputed graph alive (one per region).
        """
        self.placeholders.clear()

    def made_here(self, t: torch.Tensor) -> bool:
        """Whether an op of this recompute made ``t`` (or it stands for something, as a
        private copy or a value handed back does)."""
        provenance = self.provenance
        entry = provenance.made.get(id(t))
        if entry is not None and entry.ref() is t:
            return True
        alias = provenance.aliases.get(id(t))
        return alias is not None and alias[0]() is t

    def handle(self, t: torch.Tensor) -> int | None:
        """The forward's handle that a value autograd saves in the recompute rebuilds, if any."""
        made = self.provenance.made.get(id(t))
        if made is not None and made[0]() is t:  # an op's output (`Keeper.note_saved`)
            if self.placeholders and id(t) in self.placeholders:
                return None
            signature: Any = (made[1], made[2], t._version - made[3], t.shape, ())
        else:
            plain = _torch_private.unwrap_all(t)
            if id(plain) in self.placeholders:
                return None
            signature = _saved_value(self.provenance.describe(plain), t)
        waiting = self.handles.get(signature)
        if not waiting:
            return None
        self.last = signature
        return waiting.pop()

    def handed_back(self, value: torch.Tensor, signature: Any = None) -> None:
        """The pack hook gives autograd ``value`` for a saved value it matched (by default,
        the last): it stands for what that value's descriptor describes."""
        last = self.last if signature is None else signature
        if isinstance(last, tuple):  # (`Provenance.alias`, unrolled: once per saved value)
            value = _torch_private.unwrap_all(value)
            self.provenance.aliases[id(value)] = (
                weakref.ref(value),
                last[:-3],
                last[-3] - value._version,
            )

    def stand_in(self, copy: torch.Tensor, original: torch.Tensor, version: int) -> None:
        """``copy`` is what the forward read as ``original`` at ``version``.

        All three as the ops see them: plain tensors, below any torch.func wrappers (under a
        transform, ``functional_call`` passes a module's buffers wrapped).
        """
        plain = _torch_private.unwrap_all
        entry = self.provenance.outside.get(id(plain(original)))
        if entry is not None and entry[0]() is plain(original):  # (else the forward read none)
            self.provenance.alias(plain(copy), ("outside", entry[1], version - entry[2]))

    def _match(self, signature: Any) -> int | None:
        try:
            indices = self.keeper.table.get(signature)
        except TypeError:
            return None
        if not indices:
            return None
        key = id(indices)  # (the table holds the list: its id is its signature's, and cheap)
        k = self.cursor.get(key, 0)
        if k == len(indices):
            return None
        self.cursor[key] = k + 1
        return indices[k]

    def _skippable(self, op: Op, args: Any) -> bool:
        """A view (detach, alias) may pass its input's provenance on, so its readers need
        not depend on it: it is skipped only when its input was (it costs nothing)."""
        return not op.view or self._reads_placeholder(args)

    def _reads_placeholder(self, value: Any) -> bool:
        stack = [value]
        placeholders = self.placeholders
        while stack:
            value = stack.pop()
            if isinstance(value, torch.Tensor):
                if id(value) in placeholders:
                    return True
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
            elif isinstance(value, dict):
                stack.extend(value.values())
        return False

    def _real_layouts(self, value: Any) -> Any:
        """Placeholders replaced by empty tensors on their real devices (for ``*_like``)."""
        if isinstance(value, torch.Tensor):
            layout = self.placeholders.get(id(value))
            if layout is None:
                return value
            return torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device=layout[1]
            )
        if isinstance(value, (list, tuple)):
            return type(value)(self._real_layouts(v) for v in value)
        if isinstance(value, dict):
            return {k: self._real_layouts(v) for k, v in value.items()}
        return value

    def _placeholder(self, layout: Any) -> Any:
        if isinstance(layout, _Shape):
            t = torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype, device="meta")
            self.placeholders[id(t)] = (t, layout.device)
            return t
        return type(layout)(self._placeholder(m) for m in layout)


_META = torch.device("meta")


def _device(kwargs: dict[str, Any]) -> torch.device | None:
    device = kwargs.get("device")
    return torch.device(device) if device is not None else None


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an op argument (a tensor, or a list of them)."""
    values = value if isinstance(value, (list, tuple)) else (value,)
    return [t for t in values if isinstance(t, torch.Tensor)]


# Batch norm kernels that update the running statistics (arguments 3 and 4) in training
# (argument 5), which their schemas do not declare (nor does autograd count a version).
_UNDECLARED_WRITES = _modules.BATCH_NORM_OPS


def written(op: Op, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors an op writes in place, by its schema (and `_UNDECLARED_WRITES`)."""
    if op.func in _UNDECLARED_WRITES:
        return _tensors(list(args[3:5])) if args[5] else []
    written: list[torch.Tensor] = []
    for i, name in op.written:
        written += _tensors(args[i] if i < len(args) else kwargs.get(name))
    return written


def _move(out: Any, device: torch.device) -> Any:
    """``out``'s tensors copied to ``device``, strides kept: ops that read a copy back
    (``expand`` then ``reshape`` copies a transposed tensor, views a contiguous one) run
    what they ran on the original."""

    def move(t: torch.Tensor) -> torch.Tensor:
        pin = t.device.type == "cuda" and device.type == "cpu"
        copy = torch.empty_like(t, device=device, pin_memory=pin)
        return copy.copy_(t, non_blocking=pin or device.type == "cuda")

    return _map(out, move)

"""Per-op policies, the forward side: what the forward keeps, and what the recompute needs.

Forward (`Keeper`): every aten op of the region gets an index and a signature (see
`_provenance`). The policy decides for each op's outputs (random, in-place and view ops
always run, as does batch norm in training; `memory_budget` may keep the end of an
in-place chain, `Keeper._chains`).
When the forward ends, the ops the recompute needs are found backwards from the values
autograd saved, stopping at kept ops: those kept values are held, every other one is
released, and unneeded ops are marked to be skipped. Later forwards of the same region
follow the first one's `Program` op by op. The recompute is `_replayer`'s.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _budget, _modules, _torch_private
from ._policies import Decision, OpCall, Policy, as_decision
from ._provenance import (
    ALWAYS_RUNS,
    DECIDED,
    READS_METADATA,
    VIEW,
    Made,
    Op,
    Outside,
    Provenance,
    data_start,
    op_info,
    output_tensors,
    output_version,
    saved_as,
    saved_value,
    storage_key,
    unwrapped,
    written,
)

__all__ = ["DIVERGED", "Keeper", "Program", "Run"]

# `OpMode`'s callback: run an op (random ones under RNG replay).
Run = Callable[[Op, Any, Any], Any]


def _map(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (list, tuple)):
        return type(out)(fn(t) if isinstance(t, torch.Tensor) else t for t in out)
    return out


class Shape(NamedTuple):
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
        "early",
        "error",
        "finished",
        "kept",
        "key",
        "keys",
        "layouts",
        "made",
        "made_outside",
        "memories",
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
        "viewed",
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
        self.outside: dict[int, Outside] = {}
        self.viewed: dict[Any, tuple[int, int]] = {}  # (`Provenance.viewed`)
        self.made_outside: list[torch.Tensor] = []  # once the forward finished
        self.provenance: Provenance | None = Provenance(
            unwrapped(inputs), self.outside, forward=True, viewed=self.viewed
        )
        self.made: dict[int, Made] = {}  # the forward's, once it finished
        self.described: list[Any] = []  # handle index -> the saved value's signature
        self.kept: dict[int, tuple[Any, int]] = {}  # op index -> (output, version)
        self.keys: dict[tuple[Any, ...], int] = {}  # storage key of a kept output -> index
        self.memories: dict[int, list[int]] = {}  # where kept outputs' data starts -> indices
        self.wanted: set[int] = set()  # ops whose outputs autograd saved for a rebuild
        self.skip: dict[int, Any] = {}  # op index -> layout, once the forward finished
        self.tags: dict[int, frozenset[str]] = {}
        self.offload: dict[int, tuple[torch.device, torch.device]] = {}
        self.sources: dict[int, str] | None = {} if sources else None
        self.error: Exception | None = None
        self.early: tuple[Any, set[int]] | None = None  # `before`'s, for `after`
        self.rebuilt_before = 0
        self.skips = True
        self.finished = False
        # `memory_budget`: its plan for this region's signature, or (while it has none)
        # each op's estimated cost and the storages autograd saves.
        self.budget = policy.budget
        self.plan: _budget.Plan | None = None
        self.costs: list[float] | None = None
        self.saved_bytes: dict[int, tuple[Any, int]] = {}  # memory -> (storage, bytes)
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
        if op.writes and not op.mutable and args[5]:
            kind = ALWAYS_RUNS  # batch norm in training: it updates the running statistics
        if self.early is not None:  # (`before`)
            signature, reads = self.early
            self.early = None
        else:
            reads = set()
            signature = provenance.signature(op, args, kwargs, reads)
        self.sigs.append(signature)
        self.deps.append(() if kind == READS_METADATA else tuple(reads))
        try:  # noqa: SIM105 - `suppress` costs a context manager per op
            self.table.setdefault(signature, []).append(index)
        except TypeError:  # an unhashable argument: never matched
            pass
        step = self.budget is not None and kind == ALWAYS_RUNS and self._step(op, args, out)
        if op.mutable and self.memories:
            self._written_behind(op, args, kwargs)
        provenance.record(op, args, out, index)
        plain = True
        if type(out) is torch.Tensor:  # `Shape.of`, for the usual output
            layout = tuple.__new__(Shape, (out.shape, out.stride(), out.dtype, out.device))
        else:
            layout = Shape.of(out)
            # A wrapper subclass's output (TwoTensor, DTensor) has no stand-in: a skipped
            # op's plain ``meta`` tensor would send the ops that read it below the subclass.
            plain = all(type(t) is torch.Tensor for t in output_tensors(out))
        self.layouts.append(layout)
        decided = (kind in (DECIDED, READS_METADATA) or step) and layout is not None
        if self.budget is not None:
            decided = self._budgeted(index, op, args, kwargs, out, decided)
        if kind == ALWAYS_RUNS or layout is None:
            self.roots.append(index)
            if not (step and decided):
                return
        elif not plain:
            self.roots.append(index)  # it runs, unless the policy keeps it
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

    def before(self, op: Op, args: Any, kwargs: Any) -> None:
        """An op that reads a storage is about to run: its signature now, as the recompute
        and a following forward see it (`Provenance._storage`), for `after`."""
        assert self.provenance is not None
        reads: set[int] = set()
        self.early = (self.provenance.signature(op, args, kwargs, reads), reads)

    def follow(self, op: Op, args: Any, kwargs: Any, run: Run) -> Any:
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
        if op.mutable and self.memories:
            self._written_behind(op, args, kwargs)
        if type(out) is torch.Tensor and provenance.shared is None and not op.view:
            provenance.made[id(out)] = tuple.__new__(
                Made, (weakref.ref(out), index, 0, out._version)
            )  # `Provenance.record`, for the usual op
        else:
            provenance.record(op, args, out, index)
        decision = program.decisions.get(index)
        if decision is not None:
            self.decisions[index] = decision
            self._apply(index, decision, out)
        return out

    def _written_behind(self, op: Op, args: Any, kwargs: Any) -> None:
        """In-place op ``op`` (it just ran) wrote the memory of a kept value whose version
        did not move: through an alias with a version counter of its own (``.data``, a
        ``set_`` of it). The kept value no longer holds what its op computed, and nothing
        else tells: it is not kept (the recompute runs its op again)."""
        for t in written(op, args, kwargs):
            memory = data_start(t) if t.layout == torch.strided else None
            for index in self.memories.get(memory, ()) if memory is not None else ():
                entry = self.kept.get(index)
                if entry is not None and output_version(entry[0]) == entry[1]:
                    del self.kept[index]
                    self.offload.pop(index, None)

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
            return decided and op.kind != READS_METADATA
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
        out = self._output(index, t)
        if (
            out is not None
            and index not in self.roots
            and op_info(func).kind == DECIDED
            and decision is not Decision.RECOMPUTE
        ):
            self._apply(index, decision, out)

    def _output(self, index: int, t: torch.Tensor) -> Any:
        """Op ``index``'s whole output, of which ``t`` is one: all of them (batch norm in
        evaluation, ``max`` along a dimension), if all are alive; a replay returns them."""
        layouts = self.program.layouts if self.program is not None else self.layouts
        layout = layouts[index]
        if isinstance(layout, Shape):
            return t
        assert self.provenance is not None
        found = {m.position: m.ref() for m in self.provenance.made.values() if m.op == index}
        outputs = [found.get(position) for position in range(len(layout))]
        return None if any(o is None for o in outputs) else type(layout)(outputs)

    def _apply(self, index: int, decision: Decision, out: Any) -> None:
        # An in-place step's write counts once it returns.
        self.kept[index] = (out, output_version(out) + (index in self.steps))
        for t in output_tensors(out):
            key = storage_key(t)
            if key is not None:
                self.keys[key] = index
                self.memories.setdefault(key[0], []).append(index)
        if decision is Decision.OFFLOAD:
            target = self.policy.device or torch.device("cpu")
            self.offload[index] = (output_tensors(out)[0].device, target)
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
            # One flat tuple, `saved_value`'s: it lives until the backward.
            self.described.append((index, made[2], t._version - made[3], t.shape, ()))
        else:
            plain = _torch_private.unwrap_all(t)
            descriptor = self.provenance.describe(plain)  # the op that made it, or its alias
            index = descriptor[0] if isinstance(descriptor[0], int) else None
            if index is None and self.keys:
                index = self.keys.get(storage_key(plain))  # type: ignore[arg-type]
            self.described.append(saved_value(descriptor, t))
        if index is not None:
            self.wanted.add(index)
            if self.costs is not None:
                self._note_bytes(_torch_private.unwrap_all(t), index)

    def _note_bytes(self, t: torch.Tensor, index: int) -> None:
        """While `memory_budget` plans: the bytes of a saved value's storage, if made here."""
        key = storage_key(t)
        if key is not None and op_info(self.ops[self._base(index)]).kind != VIEW:
            # The storage is held while it plans: freed, it could lend its memory (its key)
            # to another saved value.
            storage = t.untyped_storage()
            self.saved_bytes[key[0]] = (storage, storage.nbytes())

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
                if index in needed and output_version(out) == version:
                    alias = _map(out, torch.Tensor.detach)  # shares out's version counter
                    if index in self.offload:
                        alias = _move(alias, self.offload[index][1])
                    self.kept[index] = (alias, output_version(alias))
        if self.skips:
            self.skip = skippable
        # The outputs still alive (the region's, values it cached) for the recompute to
        # find (`Provenance.earlier`); not the dead ones' records, which would live as long
        # as the graph, for the garbage collector to go through.
        made = self.provenance.made  # type: ignore[union-attr]
        self.made = {key: entry for key, entry in made.items() if entry[0]() is not None}
        self.made_outside = self.provenance.transients(outputs)  # type: ignore[union-attr]
        self.provenance, self.keys, self.memories, self.finished = None, {}, {}, True

    def _choose(self, outputs: list[torch.Tensor]) -> None:
        """`memory_budget`'s first forward of a program: choose what to keep, and plan.

        The region's outputs are the caller's: plain autograd's bytes for the region leave
        them out (the next layer holds them, as its input), and so do the candidates.
        """
        assert self.budget is not None
        assert self.costs is not None
        theirs = {data_start(_torch_private.unwrap_all(t)) for t in outputs}
        limit = self.rebuilt_before
        starts = [i for i in self.wanted if i < limit] + [r for r in self.roots if r < limit]
        candidates: dict[int, int] = {}
        for index in map(self._base, starts):
            if index in self.steps and index not in self.chains:
                continue
            entry = self.kept.get(index)
            if entry is not None and output_version(entry[0]) == entry[1]:
                made = output_tensors(entry[0])
                # (A sparse value has no storage to count: it is not kept.)
                strided = all(t.layout == torch.strided for t in made)
                if strided and not any(data_start(t) in theirs for t in made):
                    candidates[index] = sum(t.untyped_storage().nbytes() for t in made)
        theirs.discard(None)
        plain = sum(n for memory, (_, n) in self.saved_bytes.items() if memory not in theirs)
        self.saved_bytes = {}
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
                if op_info(self.ops[first]).kind in (DECIDED, READS_METADATA) and isinstance(
                    self.layouts[first], Shape
                ):
                    chains[end] = tuple(reversed(members))
        return chains

    def _base(self, index: int) -> int:
        """The op that made the memory op ``index``'s output views (a view is kept by
        keeping its base); a view op itself for a view of a region input."""
        while op_info(self.ops[index]).kind == VIEW and self.deps[index]:
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
        """A skipped value was read, or an op that did not match would have written a kept
        chain's memory: from now on the recompute runs every op it reaches, and each op of a
        kept chain (whose first op would lend it the kept value's memory)."""
        self.skips = False
        self.skip = {}
        self.chained = {}

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
        return self.finished or output_version(out) == version

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
        if output_version(alias) != version:
            from ._errors import changed_since_forward

            raise changed_since_forward(
                f"a value the policy kept (output of {self.ops[index]})",
                version,
                output_version(alias),
                "Clone it before modifying it.",
            )
        if index in self.offload:
            return _move(alias, self.offload[index][0])
        return _map(alias, torch.Tensor.detach)


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    """An input as a program's key sees it: layout, and its torch.func wrappers' kinds."""
    return t.dtype, t.device, t.requires_grad, *saved_as(t)


def _move(out: Any, device: torch.device) -> Any:
    """``out``'s tensors copied to ``device``, strides kept: ops that read a copy back
    (``expand`` then ``reshape`` copies a transposed tensor, views a contiguous one) run
    what they ran on the original."""

    def move(t: torch.Tensor) -> torch.Tensor:
        pin = t.device.type == "cuda" and device.type == "cpu"
        copy = torch.empty_like(t, device=device, pin_memory=pin)
        return copy.copy_(t, non_blocking=pin or device.type == "cuda")

    with _torch_private.Hidden():  # (remat's copies: no mode of the user's sees them)
        return _map(out, move)

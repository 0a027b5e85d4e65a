"""The torch.func bridge: run a region's recompute at its forward's levels.

Inside ``grad``/``vjp``/``jacrev`` a region re-enables saved-tensor hooks
(functorch turns them off around the forward). Backward may run under other
levels than the forward: ``vjp_fn`` called after ``vjp`` returned, ``jacrev``'s
vmapped ``vjp_fn``, ``hessian``'s ``jacfwd`` around it, or eager backward after
a ``vmap`` exited, reverse mode over ``jvp``/``jacfwd``. The recompute then pops
the levels pushed since the forward and re-creates the forward's exited ``grad``,
``vmap`` and ``jvp`` levels, one by one, re-wrapping the region's inputs (and
tensors it reads by closure) as the forward saw them: at a ``jvp`` level, as
duals with the tangents they had in the forward.
Values saved at a re-created ``grad`` level keep its wrapper, which dies with the
level; a dead wrapper acts as its contents, exactly as the forward's would.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import optree
import torch
import torch.autograd.forward_ad as fwAD
from torch.overrides import TorchFunctionMode

from . import _torch_private as tp

__all__ = ["Levels", "Replant"]

# Per forward-mode level: a tensor's tangent there, with its wrappers and own tangents.
_Tangents = dict[int, "tuple[torch.Tensor, list[Any], _Tangents] | None"]
_Wrapping = tuple[list[tuple[int, "int | None", bool]], _Tangents]


class Levels:
    """The functorch levels a region's forward ran under, and its inputs' wrappers."""

    __slots__ = ("closures", "inputs", "jvp", "stack", "witnesses")

    def __init__(
        self,
        stack: list[Level],
        witnesses: dict[int, torch.Tensor],
        inputs: list[torch.Tensor],
    ) -> None:
        self.stack, self.witnesses = stack, witnesses
        self.jvp = [desc.level for desc in stack if desc.kind == "Jvp"]
        self.inputs = [self._wrapping(t) for t in inputs]
        # Duals read by closure (under forward mode), by id: they die with their tangents.
        self.closures: dict[int, tuple[torch.Tensor, _Wrapping]] = {}

    def _wrapping(self, t: torch.Tensor) -> _Wrapping:
        """How the forward's levels wrapped ``t``: its chain, and its tangents (forward mode)."""
        return tp.wrapper_chain(t), _tangents(t, self.jvp)

    def watch_closures(self, inputs: list[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
        """For the forward: under forward mode, a mode that records duals read by closure."""
        return _ClosureWatch(self, inputs) if self.jvp else _NOTHING

    def add_closure(self, t: torch.Tensor) -> None:
        """Record ``t``, read by closure, if it is a dual at one of the forward's levels."""
        known = self.closures.get(id(t))
        if known is not None and known[0] is t:
            return
        # Wrapped at a level made inside ``fn`` (a transform it calls): not a closure.
        level = tp.wrapper_level(t)
        if all(desc.level != level for desc in self.stack):
            return
        chain, tangents = self._wrapping(t)
        if any(tangent is not None for tangent in tangents.values()):
            self.closures[id(t)] = (t, (chain, tangents))

    @classmethod
    def capture(cls, inputs: list[torch.Tensor]) -> Levels:
        interpreters = tp.functorch_interpreters()
        if not interpreters:
            return _NO_LEVELS
        stack = [_describe(i) for i in interpreters]
        witnesses = {
            i.level(): tp.level_witness(i.level())
            for i in interpreters
            if i.key().name in ("Grad", "Jvp")
        }
        return cls(stack, witnesses, inputs)

    def __bool__(self) -> bool:
        return bool(self.stack)

    def forward_mode(self) -> bool:
        """Whether the forward ran under a ``jvp`` level (tangents ride on values)."""
        return bool(self.jvp)

    def records_recompute(self, tensors: list[torch.Tensor]) -> bool:
        """Whether a level below the innermost grad level records the recompute's ops.

        A jvp level does, and so does a second grad level, or eager autograd under one
        grad level when a tensor the region reads (``tensors``) requires grad there.
        Such a level differentiates through the recompute's own ops, so a skipped op
        (a placeholder in its graph) would break it: the recompute runs every op.
        """
        grads = sum(desc.kind == "Grad" for desc in self.stack)
        if self.jvp or grads > 1:
            return True
        return grads == 1 and any(tp.unwrap_all(t).requires_grad for t in tensors)

    @staticmethod
    def _own_pass_level(t: torch.Tensor) -> int | None:
        """The grad level whose own backward pass this is, if ``t`` lives there."""
        level = tp.top_grad_level()
        if level is None or tp.wrapper_level(t) != level:
            return None
        return level if tp.in_grad_transform_backward() else None

    @staticmethod
    def for_backward(value: torch.Tensor) -> torch.Tensor:
        """What a backward formula should see of a recomputed value.

        ``torch.func.grad`` always backpropagates with ``create_graph=True``, so
        the formulas' ops would be recorded at its level (whose graph nobody
        reads) and hold every recomputed value until ``grad`` returns. In that
        pass the value is handed over as a dead twin: autograd rewraps what an
        unpack hook returns with the node's history, but a dead wrapper acts as
        its contents, so ops see no history at that level and record nothing
        there, while the levels below keep theirs.
        """
        level = Levels._own_pass_level(value)
        return value if level is None else tp.dead_twin(value, level)

    @staticmethod
    def _for_incoming(grad: torch.Tensor) -> torch.Tensor:
        level = Levels._own_pass_level(grad)
        return grad if level is None else tp.detach_outermost(grad)

    def watch_outputs(self, out: Any) -> None:
        """Give gradients reaching the region's outputs the same treatment.

        Saved values alone are not enough: the incoming gradient carries the
        level's history too, and ops on it would record all the same.
        """
        if self.stack[-1][0] != "Grad":
            return
        for leaf in optree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(Levels._for_incoming)

    def _alive(self, now: list[Level]) -> int:
        """How many of the forward's outermost levels are still the same, alive."""
        for i, desc in enumerate(self.stack):
            witness = self.witnesses.get(desc.level)
            if (
                i >= len(now)
                or now[i] != desc
                or (witness is not None and tp.is_dead_wrapper(witness))
            ):
                return i
        return len(self.stack)

    def restore(
        self, inputs: list[torch.Tensor]
    ) -> contextlib.AbstractContextManager[Replant | None]:
        """Run the block at the forward's levels; yields how to re-wrap, or None."""
        if not self.stack and not tp.functorch_interpreters():
            return _NOTHING  # (the usual: no level then, none now)
        return self._restore(inputs)

    @contextlib.contextmanager
    def _restore(self, inputs: list[torch.Tensor]) -> Iterator[Replant | None]:
        now = [_describe(i) for i in tp.functorch_interpreters()]
        alive = self._alive(now)
        if alive == len(self.stack) == len(now):
            yield None
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(tp.levels_popped(len(now) - alive))
            replant = Replant({desc.level for desc in self.stack[alive:]})
            rewraps = [
                _Rewrap(t, *wrapping, replant.dead)
                for t, wrapping in zip(inputs, self.inputs, strict=True)
            ]
            closures = {
                key: (_Rewrap(t, *wrapping, replant.dead), t)
                for key, (t, wrapping) in self.closures.items()
            }
            for desc in self.stack[alive:]:
                kind, level = desc.kind, desc.level
                if kind == "Grad":
                    # Levels below record by the grad mode the level was entered with.
                    stack.enter_context(torch.set_grad_enabled(desc.mode))
                    new = stack.enter_context(tp.new_grad_level())
                    stack.enter_context(torch.enable_grad())
                elif kind == "Vmap":
                    assert desc.batch_size is not None
                    new = stack.enter_context(tp.new_vmap_level(desc.batch_size, desc.mode))
                elif kind == "Jvp":
                    new = stack.enter_context(tp.new_jvp_level())
                else:
                    raise NotImplementedError(
                        f"`remat`: this backward runs after a torch.func `{kind.lower()}` level "
                        "of the region's forward exited, and remat cannot re-create it. Call "
                        f"the region outside `{kind.lower()}`, or run the backward inside it."
                    )
                replant.recreated.append((level, kind, new))
                for rewrap in [*rewraps, *(r for r, _ in closures.values())]:
                    rewrap.at(level, kind, new)
            replant.inputs = [rewrap.value for rewrap in rewraps]
            replant.twins = [
                (tp.unwrap_all(old), tp.unwrap_all(new))
                for rewrap, itself in [
                    *((r, False) for r in rewraps),  # inputs have their own provenance
                    *((r, True) for r, _ in closures.values()),
                ]
                for old, new in rewrap.twins(itself)
            ]
            replant.known.update({key: (t, r.value) for key, (r, t) in closures.items()})
            if replant.known or any(kind == "Grad" for _, kind, _ in replant.recreated):
                stack.enter_context(_ClosureMode(replant))
            yield replant

    def wrap(
        self, replant: Replant | None, chain: list[tuple[int, int | None, bool]], plain: Any
    ) -> torch.Tensor:
        """``plain`` wrapped as ``chain`` (`tp.wrapper_chain`) says the forward's levels
        wrapped a tensor, at the recompute's levels: the re-created twins of exited ones."""
        twins = {level: new for level, _, new in replant.recreated} if replant else {}
        value = plain
        for level, bdim, requires_grad in reversed(chain):
            at = twins.get(level, level)
            if bdim is not None:
                value = tp.add_batch_dim(value, bdim, at)
            else:  # a grad level, or a jvp level (a tensor with no tangent)
                value = tp.wrap_for_grad(value, at, requires_grad)
        return value


class _Rewrap:
    """An input, closure or tangent, moved level by level from exited levels to their twins."""

    def __init__(
        self,
        t: torch.Tensor,
        chain: list[tuple[int, int | None, bool]],
        tangents: _Tangents,
        dead: set[int],
    ) -> None:
        for level, _, _ in chain:
            if level not in dead:
                break
            t = tp.unwrap(t)
        self.original, self.value = t, t
        self.outer = {level: (bdim, requires_grad) for level, bdim, requires_grad in chain}
        self.tangents = {
            level: None if tangent is None else _Rewrap(*tangent, dead)
            for level, tangent in tangents.items()
        }

    def twins(self, itself: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(The forward's tensor, its twin) for its tangents at any depth, and itself."""
        if itself:
            yield self.original, self.value
        for tangent in self.tangents.values():
            if tangent is not None:
                yield from tangent.twins()

    def at(self, level: int, kind: str, new: int) -> None:
        """Wrap the value as the forward's level ``level`` did, at its re-created twin ``new``."""
        for tangent in self.tangents.values():
            if tangent is not None:
                tangent.at(level, kind, new)
        if level not in self.outer:
            return
        bdim, requires_grad = self.outer[level]
        if kind == "Grad":
            self.value = tp.wrap_for_grad(self.value, new, requires_grad)
        elif kind == "Vmap":
            self.value = tp.add_batch_dim(self.value, bdim, new)  # type: ignore[arg-type]
        else:
            tangent = self.tangents.get(level)
            self.value = (
                tp.wrap_for_grad(self.value, new, False)
                if tangent is None
                else fwAD.make_dual(self.value, tangent.value)
            )


class Replant:
    """Moves tensors from a forward's exited levels to their re-created twins."""

    def __init__(self, dead: set[int]) -> None:
        self.recreated: list[tuple[int, str, int]] = []
        self.dead = dead
        self.inputs: list[torch.Tensor] = []
        # Plain (forward's, twin's) pairs of tangents and closures: equal values, new objects.
        self.twins: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Tensors read by closure, by id: (the forward's, its twin at the re-created levels).
        self.known: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def closure(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor read by closure, still wrapped at an exited grad level."""
        hit = self.known.get(id(t))
        if hit is None or hit[0] is not t:
            requires_grad, inner = t.requires_grad, t
            while tp.is_dead_wrapper(inner):
                inner = tp.unwrap(inner)
            for _, kind, new in self.recreated:
                if kind == "Grad":
                    inner = tp.wrap_for_grad(inner, new, requires_grad)
            hit = self.known[id(t)] = (t, inner)
        return hit[1]


class _ClosureMode(TorchFunctionMode):
    def __init__(self, replant: Replant) -> None:
        super().__init__()
        self.replant = replant

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        call: Any = (args, kwargs or {})
        args, kwargs = optree.tree_map(self._map, call, none_is_leaf=True)
        return func(*args, **kwargs)

    def _map(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        hit = self.replant.known.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        return self.replant.closure(x) if tp.is_dead_wrapper(x) else x


class _ClosureWatch(TorchFunctionMode):
    """Records, in a forward under forward mode, the duals ``fn`` reads by closure.

    A recompute at a re-created ``jvp`` level needs their tangents, which die with
    the level. Inputs, and tensors made since the forward began, are not closures.
    """

    def __init__(self, levels: Levels, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.levels = levels
        self.made = {id(t): weakref.ref(t) for t in inputs}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        call: Any = (args, kwargs or {})
        for leaf in optree.tree_leaves(call):
            if isinstance(leaf, torch.Tensor) and not self._made(leaf):
                self.levels.add_closure(leaf)
        out = func(*call[0], **call[1])
        made: list[Any] = optree.tree_leaves(out)
        for leaf in made:
            if isinstance(leaf, torch.Tensor):
                self.made[id(leaf)] = weakref.ref(leaf)
        return out

    def _made(self, t: torch.Tensor) -> bool:
        ref = self.made.get(id(t))
        return ref is not None and ref() is t


class Level(NamedTuple):
    """A torch.func level as the interpreter stack shows it (equal levels compare equal)."""

    kind: str  # "Grad", "Vmap", "Jvp", "Functionalize"
    level: int
    mode: Any = None  # Grad: the grad mode it was entered with; Vmap: randomness; Jvp: fwd mode
    batch_size: int | None = None  # Vmap only


def _describe(interpreter: Any) -> Level:
    kind, level, *mode = interpreter.get_state()
    batch_size = interpreter.batch_size() if kind == "Vmap" else None
    return Level(kind, level, mode[0] if mode else None, batch_size)


def _tangents(t: torch.Tensor, jvp: list[int]) -> _Tangents:
    """Tangents of ``t`` per forward-mode level, with their wrappers and own tangents."""
    if not jvp:
        return {}
    return {
        level: None
        if tangent is None
        else (tangent, tp.wrapper_chain(tangent), _tangents(tangent, [j for j in jvp if j < level]))
        for level, tangent in tp.tangents(t, jvp).items()
    }


_NOTHING = contextlib.nullcontext()
_NO_LEVELS = Levels([], {}, [])

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
from collections.abc import Iterator
from typing import Any

import optree
import torch
import torch.autograd.forward_ad as fwAD
from torch.overrides import TorchFunctionMode

from . import _torch_private as tp

__all__ = ["Levels", "Replant"]


class Levels:
    """The functorch levels a region's forward ran under, and its inputs' wrappers."""

    __slots__ = ("chains", "stack", "tangents", "witnesses")

    def __init__(
        self,
        stack: list[tuple[Any, ...]],
        witnesses: dict[int, torch.Tensor],
        inputs: list[torch.Tensor],
    ) -> None:
        self.stack, self.witnesses = stack, witnesses
        self.chains = [tp.wrapper_chain(t) for t in inputs]
        # Under forward mode, each input's tangents, to make it a dual again at a twin level.
        jvp = [desc[1] for desc in stack if desc[0] == "Jvp"]
        self.tangents = [_tangents(t, jvp) for t in inputs]

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
        return any(desc[0] == "Jvp" for desc in self.stack)

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

    def _alive(self, now: list[tuple[Any, ...]]) -> int:
        """How many of the forward's outermost levels are still the same, alive."""
        for i, desc in enumerate(self.stack):
            witness = self.witnesses.get(desc[1])
            if (
                i >= len(now)
                or now[i] != desc
                or (witness is not None and tp.is_dead_wrapper(witness))
            ):
                return i
        return len(self.stack)

    @contextlib.contextmanager
    def restore(self, inputs: list[torch.Tensor]) -> Iterator[Replant | None]:
        """Run the block at the forward's levels; yields how to re-wrap, or None."""
        now = [_describe(i) for i in tp.functorch_interpreters()]
        alive = self._alive(now)
        if alive == len(self.stack) == len(now):
            yield None
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(tp.levels_popped(len(now) - alive))
            replant = Replant({desc[1] for desc in self.stack[alive:]})
            rewraps = [
                _Rewrap(t, chain, tangents, replant.dead)
                for t, chain, tangents in zip(inputs, self.chains, self.tangents, strict=True)
            ]
            for desc in self.stack[alive:]:
                kind, level = desc[0], desc[1]
                if kind == "Grad":
                    # Levels below record by the grad mode the level was entered with.
                    stack.enter_context(torch.set_grad_enabled(desc[2]))
                    new = stack.enter_context(tp.new_grad_level())
                    stack.enter_context(torch.enable_grad())
                elif kind == "Vmap":
                    new = stack.enter_context(tp.new_vmap_level(desc[3], desc[2]))
                elif kind == "Jvp":
                    new = stack.enter_context(tp.new_jvp_level())
                else:
                    raise NotImplementedError(
                        f"`remat`: this backward runs after a torch.func `{kind.lower()}` level "
                        "of the region's forward exited, and remat cannot re-create it. Call "
                        f"the region outside `{kind.lower()}`, or run the backward inside it."
                    )
                replant.recreated.append((level, kind, new))
                for rewrap in rewraps:
                    rewrap.at(level, kind, new)
            replant.inputs = [rewrap.value for rewrap in rewraps]
            if any(kind == "Grad" for _, kind, _ in replant.recreated):
                stack.enter_context(_ClosureMode(replant))
            yield replant


class _Rewrap:
    """One input, moved level by level from the forward's exited levels to their twins."""

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
        self.value = t
        self.outer = {level: (bdim, requires_grad) for level, bdim, requires_grad in chain}
        self.tangents = {
            level: None if tangent is None else _Rewrap(*tangent, dead)
            for level, tangent in tangents.items()
        }

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
        self._closures: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def closure(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor read by closure, still wrapped at an exited grad level."""
        hit = self._closures.get(id(t))
        if hit is None:
            requires_grad, inner = t.requires_grad, t
            while tp.is_dead_wrapper(inner):
                inner = tp.unwrap(inner)
            for _, kind, new in self.recreated:
                if kind == "Grad":
                    inner = tp.wrap_for_grad(inner, new, requires_grad)
            hit = self._closures[id(t)] = (t, inner)
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
        if isinstance(x, torch.Tensor) and tp.is_dead_wrapper(x):
            return self.replant.closure(x)
        return x


def _describe(interpreter: Any) -> tuple[Any, ...]:
    state: tuple[Any, ...] = interpreter.get_state()
    if state[0] == "Vmap":
        return (*state, interpreter.batch_size())
    return state


_Tangents = dict[int, "tuple[torch.Tensor, list[Any], _Tangents] | None"]


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


_NO_LEVELS = Levels([], {}, [])

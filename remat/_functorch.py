"""The torch.func bridge: which transform levels a region's forward ran under.

Inside ``grad``/``vjp``/``jacrev`` the region re-enables saved-tensor hooks
(functorch turns them off), and the recompute must run at the forward's
levels. `Levels` records them and checks, at recompute time, that backward
still runs under them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from . import _torch_private

__all__ = ["Levels"]


class Levels:
    """The functorch interpreter stack of a region's forward."""

    __slots__ = ("stack", "witnesses")

    def __init__(self, stack: list[tuple[Any, ...]], witnesses: list[torch.Tensor]) -> None:
        self.stack = stack
        self.witnesses = witnesses

    @classmethod
    def capture(cls) -> Levels:
        interpreters = _torch_private.functorch_interpreters()
        if not interpreters:
            return _NO_LEVELS
        stack = [_describe(i) for i in interpreters]
        witnesses = [
            _torch_private.level_witness(i.level())
            for i in interpreters
            if i.key().name in ("Grad", "Jvp")
        ]
        return cls(stack, witnesses)

    def __bool__(self) -> bool:
        return bool(self.stack)

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        now = [_describe(i) for i in _torch_private.functorch_interpreters()]
        dead = any(_torch_private.is_dead_wrapper(w) for w in self.witnesses)
        if now != self.stack or dead:
            raise NotImplementedError(
                "`remat`: this backward runs under different torch.func levels than the "
                f"region's forward (forward: {self.stack or 'none'}, now: {now or 'none'}"
                f"{', forward level exited' if dead else ''}). Calling `vjp_fn` after `vjp` "
                "returns, `jacrev`, `hessian`, and eager backward through `vmap` are not "
                "supported by remat yet."
            )
        yield


def _describe(interpreter: Any) -> tuple[Any, ...]:
    state: tuple[Any, ...] = interpreter.get_state()
    if state[0] == "Vmap":
        return (*state, interpreter.batch_size())
    return state


_NO_LEVELS = Levels([], [])

"""Per-op policies, the recompute side: a replay verified against the forward.

Recompute (`Replayer`): each op is matched to the first unmatched forward op with
the same signature (see `_provenance`). Equal signatures compute equal values, so only a
matched op is replayed from a kept value or skipped; an unmatched op runs for real, and
after an unmatched op that writes in place nothing more is matched. A skipped op returns
``meta`` tensors, which hold no data: reading one outside aten (``.tolist()``,
``.numpy()``) fails, as does any op that really runs on one, and the recompute then
starts again without skipping (`Restart`). A random op that is replayed or skipped
still leaves the next random op the forward's numbers (`Replayer._pass`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import _torch_private
from ._keep import Keeper, Run, Shape
from ._provenance import (
    _SELF_DESCRIBING,
    READS_METADATA,
    Made,
    Op,
    Provenance,
    arg_tensors,
    data_start,
    output_tensors,
    saved_value,
    unwrapped,
    view_key,
    written,
)
from ._rng import placeholder_maps

__all__ = ["Passed", "Replayer", "Restart"]


class Restart(BaseException):
    """A recompute read a value it skipped: run it again without skipping."""


class Stop(BaseException):
    """Every value the backward needs exists: the recompute ends (the early stop). Raised
    by its pack hook, or by `Replayer.call` (`Replayer.stop_after`)."""


# `OpMode`'s other callback: whether a random op's draw could be left out.
Passed = Callable[[Op, Any, Any], bool]


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
        "lent",
        "placeholders",
        "provenance",
        "restart",
        "rewound",
        "special",
        "stop_after",
    )

    def __init__(self, keeper: Keeper, inputs: list[torch.Tensor]) -> None:
        if keeper.program is not None and not keeper.finished:  # inside a following forward
            keeper._diverge()  # its records so far, for the replay to match against
        self.keeper = keeper
        made = keeper.provenance.made if keeper.provenance is not None else keeper.made
        self.provenance = Provenance(
            unwrapped(inputs), keeper.outside, False, made, keeper.made_outside
        )
        self.cursor: dict[int, int] = {}  # id of the table's list of indices -> next
        # saved value's signature -> its handles, last first
        self.handles: dict[Any, list[int]] = {}
        for handle in reversed(range(len(keeper.described))):
            self.handles.setdefault(keeper.described[handle], []).append(handle)
        # id -> (the placeholder, kept alive so its id stays its own; the real device)
        self.placeholders: dict[int, tuple[torch.Tensor, torch.device]] = {}
        placeholder_maps().append(self.placeholders)  # for a nested region's random ops
        self.diverged = self.restart = False
        # Every value is in, the last saved by an op that saved one with no history too:
        # that op's node (`_RecomputePack`). It runs, as it may write what it saved.
        self.stop_after: int | None = None
        self.last: Any = None
        # Memory that unmatched ops made: no matched op reads it. id -> storage ref.
        self.fresh: dict[int, weakref.ref[Any]] = {}
        # Where the kept values lent to a kept chain's first op lie (`Keeper.chain_value`):
        # the chain's steps write them as the forward did; an op that did not match must not.
        self.lent: set[int | None] = set()
        # Ids of the module tensors rewound in place for the recompute (`_as_read`).
        self.rewound: set[int] = set()
        # The ops that do not simply run again: kept, in a kept chain, or skipped.
        self.special = keeper.kept.keys() | keeper.chained.keys() | keeper.skip.keys()

    def call(self, op: Op, args: Any, kwargs: Any, run: Run, passed: Passed) -> Any:
        """One op of the recompute: its kept value, a placeholder, or what ``run`` returns.

        A step of a kept chain returns its argument, whose memory holds the chain's end
        already. A random op that does not run leaves its draw out (``passed``), or where
        that cannot be, draws into scratch memory (`_pass`).
        """
        if self.stop_after is not None:
            return self._last(op, args, kwargs, run, passed)
        provenance = self.provenance
        signature = provenance.signature(op, args, kwargs, None)
        index = None if self.diverged else self._match(signature)
        if index is None and not self.diverged and self.placeholders and _device(kwargs) == _META:
            # A factory call on the device that a skipped value's ``.device`` reported
            # (a meta placeholder's): run it where the forward did, if that matches.
            real = {device for _, device in self.placeholders.values()}
            moved = {**kwargs, "device": real.pop()} if len(real) == 1 else kwargs
            again = self._match(self.provenance.signature(op, args, moved, None))
            if again is not None:
                index, kwargs = again, moved
        if index is None and not self.diverged and self.rewound and self.keeper.viewed:
            index = self._as_read(op, args, kwargs)
        if (
            index is not None
            and not self.placeholders
            and not op.random
            and index not in self.special
        ):  # matched, and it runs: the usual op
            out = op.func(*args, **kwargs)
            if type(out) is torch.Tensor and not op.view and provenance.shared is None:
                provenance.made[id(out)] = tuple.__new__(
                    Made, (weakref.ref(out), index, 0, out._version)
                )  # `Provenance.record`, for the usual op
            else:
                provenance.record(op, args, out, index)
            return out
        keeper = self.keeper
        end = keeper.chained.get(index) if index is not None else None
        if end is not None and end in keeper.kept and keeper.replayable(end):
            if index == keeper.chains[end][0]:
                out = keeper.chain_value(end)
                self.lent.add(data_start(out))
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
            if index is None and op.mutable and self.lent and self._writes_lent(op, args, kwargs):
                # It would write a kept value (its own version counter does not show it):
                # run again without replaying chains.
                self.restart = True
                raise Restart
            if self.placeholders and self._reads_placeholder((args, kwargs)):
                if op.kind != READS_METADATA:
                    self.restart = True
                    raise Restart
                args, kwargs = self._real_layouts((args, kwargs))
            out = run(op, args, kwargs)
            if self.placeholders and any(t.device.type == "meta" for t in output_tensors(out)):
                self.restart = True  # a skipped value reached a real result some other way
                raise Restart
            if index is None:
                if not op.mutable:
                    self._made_fresh(op, args, out)
                elif not self._harmless(op, args, kwargs):
                    self.diverged = True  # an unknown write: aliases may now hold anything
        self.provenance.record(op, args, out, -1 if index is None else index)
        return out

    def _writes_lent(self, op: Op, args: Any, kwargs: Any) -> bool:
        return any(data_start(t) in self.lent for t in written(op, args, kwargs))

    def _last(self, op: Op, args: Any, kwargs: Any, run: Run, passed: Passed) -> Any:
        """Stop at the op after every value is in (`stop_after`): once it has run, if it is
        the op that saved the last one and writes an argument; before it, if not."""
        node, self.stop_after = self.stop_after, None
        if op.mutable and _torch_private.last_node() == node:
            self.call(op, args, kwargs, run, passed)
        raise Stop

    def _pass(
        self, op: Op, args: Any, kwargs: Any, run: Run, passed: Passed, in_place: bool = False
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
        inputs = [t for arg in args for t in arg_tensors(arg) if t.layout == torch.strided]
        read = {id(t.untyped_storage()) for t in inputs}
        for t in output_tensors(out):
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
        maps = placeholder_maps()
        for i in range(len(maps) - 1, -1, -1):  # by identity: an empty dict equals another
            if maps[i] is self.placeholders:
                del maps[i]
                break

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
            signature = saved_value(self.provenance.describe(plain), t)
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

    def same(self, t: torch.Tensor, made: torch.Tensor) -> None:
        """``t`` holds what ``made``, an output of an op of the recompute, holds (a view of
        a module tensor that ``made`` views the private copy of: `WriteGuard.returned`)."""
        plain = _torch_private.unwrap_all
        self.provenance.alias(plain(t), self.provenance.describe(plain(made)))

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

    def _as_read(self, op: Op, args: Any, kwargs: Any) -> int | None:
        """The op, if it matches once its arguments that view a module tensor rewound in
        place stand for the view of the same memory that the forward read from outside.

        A view the forward takes anew at each call and keeps where remat does not look
        (a plain object's attribute): the recompute reads the one its own forward took,
        which an op of that forward made, where the forward read the one its call before
        took. The tensor is rewound to its content and version at the forward's entry, so
        the same memory at the same version holds what the forward read.
        """
        provenance = self.provenance
        added = []
        for t in arg_tensors(list(args)):
            made = provenance.made.get(id(t))
            if (
                type(t) is not torch.Tensor
                or t._base is None
                or id(t._base) not in self.rewound
                or (made is not None and made.ref() is t)
                or id(t) in provenance.aliases
            ):
                continue
            shown = view_key(t)
            read = self.keeper.viewed.get(shown) if shown is not None else None
            if read is not None:
                provenance.alias(t, ("outside", read[0], t._version - read[1]))
                added.append(id(t))
        if not added:
            return None
        index = self._match(provenance.signature(op, args, kwargs, None))
        if index is None:
            for key in added:
                del provenance.aliases[key]
        return index

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
                if not _SELF_DESCRIBING.issuperset(map(type, value)):  # (sizes: natively)
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
        if isinstance(layout, Shape):
            t = torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype, device="meta")
            self.placeholders[id(t)] = (t, layout.device)
            return t
        return type(layout)(self._placeholder(m) for m in layout)


_META = torch.device("meta")


def _device(kwargs: dict[str, Any]) -> torch.device | None:
    device = kwargs.get("device")
    return torch.device(device) if device is not None else None

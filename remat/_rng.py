"""RNG capture: the recompute draws the forward's random numbers.

A generator's state is kept (as a value) only if the region drew from it. The
forward and its recompute run under the same dispatch setup (composite ops such
as ``reshape`` decompose differently under a Python dispatch mode), so there are
two ways:

- With remat's dispatch mode (per-op policies, `remat.debug`, and any region
  whose forward starts while other threads are alive), each random op draws
  from a private generator set to the shared one's state, which is then moved
  on past the draw; the state is kept per op. The recompute runs each random op
  on a private clone set to that op's state. Other threads drawing in between
  cannot shift what a region draws or replays. A random op on a generator the
  forward did not draw from, or one op too many, raises.
- Without it, the default generators (CPU, and CUDA devices in use) and the
  explicit generators the region can see are read before the forward, and a
  state is kept only if it changed. The recompute lends each kept state to its
  generator and gives the caller's state back when it ends (also under the mode,
  a region's first calls', which checks its random ops are the forward's); when
  other threads are alive by then, it replays on private clones instead.

Either way the caller's generators end where plain autograd leaves them. A nested
region's recompute inside this region's forward or recompute replays its own numbers:
this region's capture and replay let its random ops pass (`_enter_recompute`).
Threads that draw outside remat regions are not synchronized with: one that
draws while a region's random op runs may draw the same numbers.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import _torch_private
from ._errors import RecomputeError
from ._torch_private import functorch_cleared, generator_identity

__all__ = [
    "GeneratorWatch",
    "RngCapture",
    "RngLend",
    "RngReplay",
    "is_random",
    "placeholder_maps",
    "threaded",
]

_local = threading.local()
# Held while a region's random op draws: regions in other threads wait, not interleave.
_DRAWING = threading.RLock()


def _state(generator: torch.Generator) -> torch.Tensor:
    """``generator.get_state()``, holding `_DRAWING` (the generators are shared). torch's
    getter holds the generator's mutex while it wraps the state as a Python tensor, which
    can run the garbage collector and give up the GIL: another thread's getter that holds
    the GIL then waits for that mutex, and both wait for ever."""
    with _DRAWING:
        return generator.get_state()


def _set_state(generator: torch.Generator, state: torch.Tensor) -> None:
    """``generator.set_state(state)``, holding `_DRAWING` (see `_state`)."""
    with _DRAWING:
        generator.set_state(state)


def threaded() -> bool:
    """Whether other threads are alive, which may draw from the shared generators.

    Threads whose code never draws do not count, though they live as long as the
    process: tqdm's monitor thread, which only refreshes stalled progress bars (any bar
    starts it, torch.compile's do), inductor's compile threads, and a Jupyter kernel's
    own threads (`_KERNEL_THREADS`).
    """
    if threading.active_count() == 1:
        return False
    current = threading.current_thread()
    return any(t is not current and not _quiet(t) for t in threading.enumerate())


# Threads by identity: whether they never draw (`threaded`). A thread's code is fixed.
_QUIET: weakref.WeakKeyDictionary[threading.Thread, bool] = weakref.WeakKeyDictionary()


def _quiet(thread: threading.Thread) -> bool:
    quiet = _QUIET.get(thread)
    if quiet is None:
        monitor = getattr(sys.modules.get("tqdm._monitor"), "TMonitor", ())
        quiet = (
            isinstance(thread, monitor)
            or _torch_private.inductor_thread(thread)
            or _kernel_thread(thread)
        )
        _QUIET[thread] = quiet
    return quiet


# The threads of a Jupyter kernel (ipykernel, IPython) that run none of the user's code:
# its message channels, output streams, heartbeat, parent poller and history writer, by
# class or by the method they run. A subshell's thread runs cells: it is not here.
_KERNEL_THREADS = frozenset(
    {
        "ControlThread",
        "Heartbeat",
        "HistorySavingThread",
        "IOPubThread._thread_main",
        "OutStream._watch_pipe_fd",
        "ParentPollerUnix",
        "ParentPollerWindows",
        "ShellChannelThread",
    }
)


def _kernel_thread(thread: threading.Thread) -> bool:
    kind = type(thread)
    if kind.__module__.startswith(("ipykernel.", "IPython.")):
        return kind.__qualname__ in _KERNEL_THREADS
    target = getattr(thread, "_target", None)  # what a plain Thread runs, while it runs
    owner = type(getattr(target, "__self__", None))
    return (
        owner.__module__.startswith("ipykernel.")
        and f"{owner.__qualname__}.{getattr(target, '__name__', '')}" in _KERNEL_THREADS
    )


def is_random(func: Any) -> bool:
    """Whether an aten op draws from a generator."""
    return torch.Tag.nondeterministic_seeded in func.tags


def placeholder_maps() -> list[dict[int, tuple[torch.Tensor, torch.device]]]:
    """This thread's per-op recomputes' placeholders: id -> (placeholder, real device).

    An outer region's placeholder (a meta tensor) may reach a random op of a nested
    region's recompute, as ``rand_like``'s layout: the op draws on the real device.
    """
    return _local.__dict__.setdefault("placeholders", [])


def _op_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if arg.device.type == "meta":
                for placeholders in placeholder_maps():
                    if id(arg) in placeholders:
                        return placeholders[id(arg)][1]
            return arg.device
    return torch.get_default_device()


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


def _op_generator(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | None:
    generator = kwargs.get("generator")
    if generator is not None:
        return generator
    return _default_generator(_op_device(args, kwargs))


def _find(clones: dict[torch.Generator, torch.Generator], generator: torch.Generator) -> Any:
    """The clone of ``generator``, also when torch hands it over as another Python object.

    A dispatch mode sees an explicit generator as another wrapper of the same C++
    generator (two generators may well share seed and state).
    """
    clone = clones.get(generator)
    if clone is None:
        clone = clones.get(_find_original(clones, generator))
        if clone is not None:
            clones[generator] = clone
    return clone


def _find_original(clones: dict[torch.Generator, torch.Generator], generator: Any) -> Any:
    """The generator among ``clones``' keys that ``generator`` wraps (see `_find`)."""
    identity = generator_identity(generator)
    for original in clones:
        if generator_identity(original) == identity:
            return original
    return generator


def _bytes(state: torch.Tensor) -> bytes:
    """A generator state to compare: not with an aten op, which a user's mode would see
    (``.numpy()``, outside torch.func's levels, which refuse it)."""
    with functorch_cleared():
        return state.numpy().tobytes()


def _set_inside(generator: torch.Generator, seen: bytes, before: torch.Tensor) -> bool:
    """Whether ``fn`` seeded or set ``generator`` in a recompute, whose draws are on clones:
    its state moved from ``seen``. With other threads alive, only a seed tells (their
    draws move it too): the state its seed gives, or another seed than ``before``'s."""
    if _bytes(_state(generator)) == seen:
        return False
    if not threaded():
        return True
    fresh = torch.Generator(device=generator.device)
    fresh.set_state(before)
    return generator.initial_seed() != fresh.initial_seed() or _fresh(generator)


def _active(generator: torch.Generator) -> torch.Generator:
    """The generator an op really draws from: a replay clone inside a recompute."""
    replaying = _replaying(generator)
    return replaying[1] if replaying is not None else generator


def _standing_for(generator: torch.Generator) -> torch.Generator | None:
    """The generator that ``generator``, a nested region's private one, draws in place of."""
    for private, source in reversed(getattr(_local, "drawing", ())):
        if generator is private or (
            generator.device == private.device and torch.equal(_state(generator), _state(private))
        ):
            return source
    return None


def _replaying(generator: torch.Generator) -> tuple[RngReplay, torch.Generator] | None:
    """The recompute replaying ``generator`` on this thread, and its clone: the innermost
    recompute, if it replays (those around it let its random ops pass)."""
    recomputes = getattr(_local, "recomputes", ())
    replay = recomputes[-1] if recomputes else None
    if isinstance(replay, RngReplay):
        clone = _find(replay.clones, generator)
        if clone is not None:
            return replay, clone
    return None


def _recomputes() -> int:
    """How many recomputes are running on this thread, nested (`RngReplay`, `RngLend`)."""
    return len(getattr(_local, "recomputes", ()))


def _enter_recompute(recompute: object) -> int:
    """Note that ``recompute`` runs; its depth. Random ops deeper than a capture's or a
    replay's own are a nested region's recompute, which draws on its own: they pass."""
    stack = _local.__dict__.setdefault("recomputes", [])
    stack.append(recompute)
    return len(stack)


def _exit_recompute() -> None:
    _local.recomputes.pop()


def _default_generators() -> list[torch.Generator]:
    generators = [torch.default_generator]
    if torch.cuda.is_initialized():
        generators.extend(torch.cuda.default_generators)
    return generators


def _fresh(generator: torch.Generator) -> bool:
    """Whether ``generator`` is at the state its seed gives: one ``fn`` made and seeded.

    The recompute draws from such a generator itself: ``fn`` made it again, and the
    forward drew the same numbers from its own.
    """
    return _bytes(_state(generator)) == _bytes(_initial_state(generator))


def _initial_state(generator: torch.Generator) -> torch.Tensor:
    """The state a lazily initialized (CUDA) generator starts from."""
    fresh = torch.Generator(device=generator.device)
    fresh.manual_seed(generator.initial_seed())
    return fresh.get_state()


# Random ops by id: (the op, held so that its id stays its own; whether it takes a generator).
_TAKES_GENERATOR: dict[int, tuple[Any, bool]] = {}


def _takes_generator(func: Any) -> bool:
    known = _TAKES_GENERATOR.get(id(func))
    if known is None:  # reading the schema costs a microsecond: once per op
        takes = any(arg.name == "generator" for arg in func._schema.arguments)
        known = _TAKES_GENERATOR[id(func)] = (func, takes)
    return known[1]


def _draw(func: Any, args: Any, kwargs: Any, generator: torch.Generator, private: Any) -> Any:
    """Run random op ``func`` (whose generator is ``generator``) on ``private`` instead."""
    subclass = any(type(a) is not torch.Tensor and isinstance(a, torch.Tensor) for a in args)
    if _takes_generator(func) and not subclass:
        return func(*args, **{**kwargs, "generator": private})
    # No `generator=` in the schema (CUDA's fused native_dropout), or a tensor subclass's,
    # whose dispatch may draw from the default generator whatever it is given (DTensor):
    # lend the private state to the op's generator for this one op. The generator is
    # shared: another thread's region must not read or lend it meanwhile (a recompute on
    # autograd's device thread, say, while a forward captures).
    with _DRAWING:
        caller_state = generator.get_state()
        generator.set_state(private.get_state())
        try:
            out = func(*args, **kwargs)
            private.set_state(generator.get_state())
        finally:
            generator.set_state(caller_state)
    return out


class RngCapture:
    """Generator states a region consumed, as values."""

    __slots__ = ("cuda_ready", "depth", "draws", "ops", "snapshot", "states")

    def __init__(self) -> None:
        # A nested region's recompute inside this forward (an ``autograd.grad`` in ``fn``)
        # replays the nested region's numbers: its draws are not this region's.
        self.depth = _recomputes()
        self.states: dict[torch.Generator, torch.Tensor] = {}  # the first state drawn from
        # Per random op (under a mode): the state it drew from, and the op.
        self.draws: dict[torch.Generator, list[tuple[torch.Tensor, Any]]] = {}
        self.snapshot: list[tuple[torch.Generator, torch.Tensor]] = []
        self.cuda_ready = True
        # A watched forward's random ops, not captured per op (`saw`): None if not watched.
        self.ops: list[Any] | None = None

    def saw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A watched forward, not capturing per op, ran random op ``func``: its recompute
        checks that it runs the same (a first call may draw numbers later calls do not)."""
        generator = _op_generator(args, kwargs)
        if self.ops is not None and generator is not None and _recomputes() <= self.depth:
            self.ops.append(func)

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Under a dispatch mode: run a random op on a private generator, keeping its state."""
        generator = _op_generator(args, kwargs)
        if generator is None or _recomputes() > self.depth:
            return func(*args, **kwargs)
        replaying = _replaying(generator)
        if replaying is not None:  # inside a recompute, whose replay draws this op
            state = replaying[0].next_state(replaying[1])
            out = func(*args, **kwargs)
        else:
            # A nested region's private generator: the draw is from the one it stands for.
            source = _standing_for(generator) or generator
            with _DRAWING:
                state = generator.get_state()
                private = torch.Generator(device=generator.device)
                private.set_state(state)
                drawing = _local.__dict__.setdefault("drawing", [])
                drawing.append((private, source))
                try:
                    out = _draw(func, args, kwargs, generator, private)
                finally:
                    drawing.pop()
                generator.set_state(private.get_state())
            generator = source
        self.states.setdefault(generator, state)
        self.draws.setdefault(generator, []).append((state, func))
        return out

    def start(self, visible: list[torch.Generator]) -> None:
        """Without a dispatch mode: read every generator the region may draw from."""
        self.cuda_ready = torch.cuda.is_initialized()
        generators = dict.fromkeys([*_default_generators(), *visible])
        self.snapshot = [(g, _state(_active(g))) for g in generators]

    def finish(self) -> None:
        """Keep the states of the generators the forward drew from, and of every explicit
        one (``fn`` may draw from it and then seed it back where it began)."""
        defaults = _default_generators()
        for generator, state in self.snapshot:
            if generator not in defaults or not torch.equal(_state(_active(generator)), state):
                self.states.setdefault(generator, state)
        if not self.cuda_ready and torch.cuda.is_initialized():  # first used in the region
            for generator in torch.cuda.default_generators:
                initial = _initial_state(generator)
                if not torch.equal(_state(generator), initial):
                    self.states.setdefault(generator, initial)
        self.snapshot = []

    def lendable(self) -> dict[torch.Generator, torch.Tensor]:
        """The states a recompute starts from; inside the forward (an ``autograd.grad`` in
        ``fn``), those read when it began."""
        return dict(self.snapshot) if self.snapshot else self.states

    def replay(self, per_op: bool) -> RngReplay:
        """Clones to replay on; ``per_op`` if the forward captured each random op.

        Without per-op states and with no other thread alive, the states are lent to the
        generators themselves, as without a mode: ``fn`` then drives them as it did in the
        forward (seeds one inside ``fork_rng``, draws in a thread it starts)."""
        ops = None if self.ops is None else list(reversed(self.ops))
        if not per_op and not threaded():
            return RngReplay({g: g for g in self.lendable()}, {}, per_op, ops, self.lendable())
        clones, draws = {}, {}
        for generator, state in self.lendable().items():
            clone = torch.Generator(device=generator.device)
            clone.set_state(state)
            clones[generator] = clone
            if generator in self.draws:
                draws[clone] = list(reversed(self.draws[generator]))
        return RngReplay(clones, draws, per_op, ops)


class RngLend:
    """For one recompute without a dispatch mode: the forward's states, lent to the generators
    (the caller's given back when it ends)."""

    def __init__(self, states: dict[torch.Generator, torch.Tensor]) -> None:
        self.states = states
        self.caller: list[tuple[torch.Generator, torch.Tensor]] = []

    def __enter__(self) -> RngLend:
        # To the generators themselves, also inside an outer region's recompute: the
        # outer's replay lets this one's random ops pass (`_enter_recompute`).
        _enter_recompute(self)
        for generator, state in self.states.items():
            self.caller.append((generator, _state(generator)))
            _set_state(generator, state)
        return self

    def __exit__(self, *exc: Any) -> None:
        for generator, state in reversed(self.caller):
            _set_state(generator, state)
        self.caller = []
        _exit_recompute()


class GeneratorWatch(TorchFunctionMode):
    """For one recompute without a dispatch mode: watches its torch calls (a function mode
    leaves aten decompositions alone). One with an explicit ``generator=`` the forward did
    not capture raises, rather than draw other numbers and move that generator on twice;
    the ``watched`` functions are checked by ``watch`` (batch norm's: `SecondUpdates`).

    It is the price of that check: the recompute's every torch call goes through it.
    """

    def __init__(
        self,
        states: dict[torch.Generator, torch.Tensor],
        watched: frozenset[Any] = frozenset(),
        watch: Callable[[Any, tuple[Any, ...], dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__()
        self.states = states
        self.made: list[torch.Generator] = []  # by ``fn``: seeded when it first drew
        # Other torch functions to check on the way (`watch` is called before each runs).
        self.watched, self.watch = watched, watch

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in self.watched:
            assert self.watch is not None
            self.watch(func, args, kwargs or {})
        if not kwargs:  # (most calls: checked first, as this runs for every torch call)
            return func(*args)
        generator = kwargs.get("generator")
        if (
            generator is not None
            and isinstance(generator, torch.Generator)
            and generator not in self.states
            and not any(generator is made for made in self.made)
        ):
            if not _fresh(generator):
                raise RecomputeError(
                    f"`remat`: the recompute's {getattr(func, '__name__', func)} draws from a "
                    f"generator ({generator.device}) that the forward's capture did not see. Pass "
                    "it to the function as an argument (or keep it in a closure, a global the "
                    "function names, or a module attribute)."
                )
            self.made.append(generator)
        return func(*args, **kwargs)


class RngReplay:
    """Runs random ops of one recompute on clones of the forward's generators.

    A clone is set to each op's own state where the forward kept them per op, and
    otherwise draws on from where the forward started. A generator ``fn`` seeds (or sets)
    itself acts on the generator, not the clone: the clone takes the state it set (as
    the forward drew from it), and the generator gets the caller's state back at the end.
    Where the states are ``lent``, each generator is its own clone (`RngCapture.replay`),
    and every generator gets the caller's state back.
    """

    __slots__ = ("caller", "clones", "depth", "draws", "lent", "ops", "per_op")

    def __init__(
        self,
        clones: dict[torch.Generator, torch.Generator],
        draws: dict[torch.Generator, list[tuple[torch.Tensor, Any]]],
        per_op: bool,
        ops: list[Any] | None = None,
        lent: dict[torch.Generator, torch.Tensor] | None = None,
    ) -> None:
        self.clones = clones  # each generator its own clone where its state is ``lent``
        self.lent = lent
        self.draws = draws  # clone -> the forward's ops and their states, last first
        self.ops = ops  # a watched forward's random ops, last first (`RngCapture.saw`)
        # Without per-op capture, a default generator the forward left unchanged is one
        # its random ops did not draw from (dropout with p=0 is tagged random too).
        self.per_op = per_op
        self.depth = 0
        # Per generator: its state as the recompute began, the state a draw last saw (as
        # bytes), and whether ``fn`` set it.
        self.caller: dict[torch.Generator, tuple[torch.Tensor, bytes, bool]] = {}

    def __enter__(self) -> RngReplay:
        self.depth = _enter_recompute(self)
        for generator in dict.fromkeys([*self.clones, *_default_generators()]):
            state = _state(generator)
            self.caller[generator] = (state, _bytes(state), False)
        for generator, state in (self.lent or {}).items():
            _set_state(generator, state)
        return self

    def __exit__(self, *exc: object) -> None:
        _exit_recompute()
        for generator, (state, seen, set_inside) in self.caller.items():
            if self.lent is not None or set_inside or _set_inside(generator, seen, state):
                _set_state(generator, state)

    def _follow(self, generator: torch.Generator, clone: torch.Generator) -> None:
        """If ``fn`` set ``generator``'s state since the last draw, draw on from there."""
        entry = self.caller.get(generator)
        if entry is not None and _set_inside(generator, entry[1], entry[0]):
            state = _state(generator)
            clone.set_state(state)
            self.caller[generator] = (entry[0], _bytes(state), True)

    def next_state(self, clone: torch.Generator) -> torch.Tensor:
        """The state ``clone`` draws the next random op from."""
        states = self.draws.get(clone)
        return states[-1][0] if states else _state(clone)

    def skip(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Leave out random op ``func``'s draw, if the forward kept the state of each op
        of its generator (the next op then starts from its own); else False."""
        if _recomputes() > self.depth:  # a nested region's recompute: it runs
            return False
        generator = _op_generator(args, kwargs)
        clone = _find(self.clones, generator) if generator is not None else None
        if clone is None or not self.draws.get(clone):
            return False
        _drawn_by(self.draws[clone].pop(), func, clone)
        return True

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        generator = _op_generator(args, kwargs)
        if generator is None or _recomputes() > self.depth:
            return func(*args, **kwargs)
        if self.ops is not None:
            _same_op(self.ops.pop() if self.ops else None, func, generator)
        clone = _find(self.clones, generator)
        if clone is None and "generator" in kwargs and _fresh(generator):
            self.clones[generator] = clone = generator  # made and seeded inside ``fn``
        if clone is None and "generator" not in kwargs and not self.per_op:
            clone = generator  # whatever it draws, the caller's state comes back (lent)
            if self.lent is None:  # or not from the caller's
                clone = torch.Generator(device=generator.device)
                _set_state(clone, _state(generator))
            self.clones[generator] = clone
        if clone is None:
            raise RecomputeError(
                f"`remat`: the recompute's {func} draws from a generator ({generator.device}) "
                "that the forward did not draw from, or that remat could not see. Pass an "
                "explicit `torch.Generator` to the function as an argument (or keep it in a "
                "closure, a global the function names, or a module attribute)."
            )
        states = self.draws.get(clone)
        if states is not None:
            if not states:
                raise RecomputeError(
                    f"`remat`: the recompute's {func} is one random op more than the forward "
                    f"drew from its generator ({generator.device}). `fn` must run the same "
                    "random ops each time it is called."
                )
            _set_state(clone, _drawn_by(states.pop(), func, clone))
        elif self.lent is not None:  # each generator its own clone
            return func(*args, **kwargs)
        else:
            self._follow(_find_original(self.clones, generator), clone)
        return _draw(func, args, kwargs, generator, clone)


def _drawn_by(entry: tuple[torch.Tensor, Any], func: Any, generator: torch.Generator) -> Any:
    """The state the forward's random op ``entry`` drew from, checked to be ``func``'s."""
    _same_op(entry[1], func, generator)
    return entry[0]


def _same_op(drawn: Any, func: Any, generator: torch.Generator) -> None:
    """The recompute's random op ``func`` is where the forward ran ``drawn`` (None: none)."""
    if drawn is not func:
        where = "after the forward's last" if drawn is None else f"where the forward's {drawn} did"
        raise RecomputeError(
            f"`remat`: the recompute's {func} draws from a generator ({generator.device}) "
            f"{where}: `fn` must run the same random ops each time it is called. (A module "
            "made or first initialized inside `fn`, such as a submodule built on the first "
            "call or a lazy module, draws its initial weights in the forward only: call the "
            "model once before remat.)"
        )

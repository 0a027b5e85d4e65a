"""The decorator surface of `remat`: forms, metadata, methods, pytrees, call-site errors."""

import collections
import functools
import inspect
import operator
import types

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from remat import _engine, policies, remat


def _block(x, w):
    """Two ops whose backward needs recomputed intermediates."""
    return (x @ w).tanh().sin()


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, w


def _grads(fn, *tensors):
    """Output of ``fn(*tensors)`` and its gradients with respect to every tensor."""
    out = fn(*tensors)
    return out, torch.autograd.grad(out.square().sum(), tensors)


def _assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert torch.equal(ga, gb)


@pytest.fixture
def regions(monkeypatch):
    """Every `Region` constructed while the test runs, in order."""
    made = []
    init = _engine.Region.__init__

    def spy(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(_engine.Region, "__init__", spy)
    return made


@pytest.fixture
def no_regions(monkeypatch):
    """Fail the test if any `Region` is constructed."""

    def forbidden(self, *args, **kwargs):
        raise AssertionError("a remat Region was constructed")

    monkeypatch.setattr(_engine.Region, "__init__", forbidden)


FORMS = {
    "@remat": lambda fn: remat(fn),
    "@remat()": lambda fn: remat()(fn),
    "@remat(policy='save_nothing')": lambda fn: remat(policy="save_nothing")(fn),
    "remat(fn, policy=policies.save_nothing)": lambda fn: remat(fn, policy=policies.save_nothing),
}


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_decorator_forms_recompute_and_match_fn(form, regions):
    """Every decorator form builds a save_nothing region that matches ``fn`` bitwise."""
    calls = []

    def fn(x, w):
        calls.append(None)
        return _block(x, w)

    wrapped = form(fn)
    assert wrapped.policy is policies.save_nothing
    _assert_same(_grads(wrapped, *_inputs()), _grads(_block, *_inputs()))
    assert len(regions) == 1
    assert len(calls) == 2


def test_wraps_metadata():
    """The wrapper carries ``fn``'s name, qualname, doc, module and signature."""
    wrapped = remat(_block)
    assert wrapped.__name__ == "_block"
    assert wrapped.__qualname__ == _block.__qualname__
    assert wrapped.__doc__ == "Two ops whose backward needs recomputed intermediates."
    assert wrapped.__module__ == _block.__module__
    assert wrapped.__wrapped__ is _block
    assert inspect.signature(wrapped) == inspect.signature(_block)


@pytest.mark.parametrize(
    ("policy", "resolved"),
    [
        ("save_nothing", policies.save_nothing),
        ("save_everything", policies.save_everything),
        (policies.save_nothing, policies.save_nothing),
        (policies.save_everything, policies.save_everything),
    ],
    ids=["str-nothing", "str-everything", "obj-nothing", "obj-everything"],
)
def test_policy_attribute_is_resolved_object(policy, resolved):
    """``wrapper.policy`` is the policy object, whether given by name or as an object."""
    assert remat(_block, policy=policy).policy is resolved
    assert remat(policy=policy)(_block).policy is resolved


class _Affine:
    def __init__(self, w):
        self.w = w
        self.selves = []

    def apply(self, x):
        self.selves.append(self)
        return _block(x, self.w)


class _DecoratedAffine(_Affine):
    @remat
    def apply(self, x):
        self.selves.append(self)
        return _block(x, self.w)


def test_bound_method(regions):
    """``remat(obj.method)`` recomputes and gradients reach the tensors read via ``self``."""
    x, w = _inputs()
    obj = _Affine(w)
    method = obj.apply
    wrapped = remat(method)
    assert wrapped.__wrapped__ is method
    _assert_same(_grads(lambda x, w: wrapped(x), x, w), _grads(_block, *_inputs()))
    assert len(regions) == 1
    assert obj.selves == [obj, obj]


def test_method_decorated_in_class_body(regions):
    """``@remat`` on a method in a class body binds ``self`` and reaches its tensors."""
    x, w = _inputs()
    obj = _DecoratedAffine(w)
    assert _DecoratedAffine.apply.__wrapped__.__name__ == "apply"
    _assert_same(_grads(lambda x, w: obj.apply(x), x, w), _grads(_block, *_inputs()))
    assert len(regions) == 1
    assert all(s is obj for s in obj.selves)
    assert len(obj.selves) == 2


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(3, 8, dtype=torch.float64)
        self.down = nn.Linear(8, 3, dtype=torch.float64)
        # Runs, recomputes included, counted on an object that is not a module: remat shows
        # each recompute a module's own attributes as the forward read them.
        self.calls = types.SimpleNamespace(count=0)

    def forward(self, x):
        self.calls.count += 1
        return self.down(torch.relu(self.up(x)).sin())


class _RematMlp(_Mlp):
    @remat
    def forward(self, x):
        return super().forward(x)


def test_module_forward_decorated_in_class(regions):
    """A remat'd ``nn.Module.forward`` gives its parameters the plain module's gradients."""
    torch.manual_seed(0)
    plain = _Mlp()
    checkpointed = _RematMlp()
    checkpointed.load_state_dict(plain.state_dict())
    x, _ = _inputs()
    for module in (plain, checkpointed):
        module(x).square().sum().backward()
    assert len(regions) == 1
    assert (plain.calls.count, checkpointed.calls.count) == (1, 2)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_keyword_arguments_and_nested_tensors(regions):
    """Tensors passed by keyword, at any depth, get the plain gradients."""

    def fn(x, *, params, scale):
        (b,) = params["bias"]
        return (x @ params["w"] + b).tanh().sin() * scale

    def run(fn, x, w, b):
        return fn(x, params={"w": w, "bias": [b]}, scale=2.0)

    x, w = _inputs()
    b = torch.linspace(-1, 1, 3, dtype=torch.float64, requires_grad=True)
    expected = _grads(functools.partial(run, fn), *_inputs(), b)
    _assert_same(_grads(functools.partial(run, remat(fn)), x, w, b), expected)
    assert len(regions) == 1


def test_non_tensor_leaves_pass_through_as_same_objects():
    """Non-tensor leaves reach ``fn`` (forward and recompute) and the output as themselves;
    the containers holding them, in the recompute, rebuilt (equal, of the same type)."""
    marker, label, items = object(), "tag", (1, 2.5, None)
    seen = []

    def fn(x, config, *, extra):
        seen.append((config["marker"], config["label"], extra))
        return {"y": x.sin().exp(), "marker": config["marker"], "extra": extra}

    x, _ = _inputs()
    out = remat(fn)(x, {"marker": marker, "label": label}, extra=items)
    assert out["marker"] is marker
    assert out["extra"] is items
    out["y"].sum().backward()
    assert len(seen) == 2
    for seen_marker, seen_label, seen_extra in seen:
        assert seen_marker is marker
        assert seen_label is label
        assert seen_extra == items
        assert all(map(operator.is_, seen_extra, items))
    assert seen[0][2] is items  # the forward's: the caller's own


@pytest.mark.parametrize("fn", [42, "fn", torch.ones(2)], ids=["int", "str", "tensor"])
def test_non_callable_fn_raises_type_error(fn):
    """A non-callable ``fn`` raises TypeError naming what was received."""
    with pytest.raises(TypeError, match="`remat` expected a callable `fn`, got") as info:
        remat(fn)
    assert f"of type {type(fn).__name__}" in str(info.value)
    with pytest.raises(TypeError, match="`remat` expected a callable `fn`, got"):
        remat(policy="save_nothing")(fn)


@pytest.mark.parametrize(
    "make",
    [lambda: remat(_block, policy="save_all"), lambda: remat(policy="save_all")],
    ids=["direct", "decorator"],
)
def test_unknown_policy_name_lists_valid_names(make):
    """An unknown policy name raises ValueError listing the valid names."""
    with pytest.raises(ValueError, match="`remat`: unknown policy 'save_all'") as info:
        make()
    assert "'save_nothing'" in str(info.value)
    assert "'save_everything'" in str(info.value)


@pytest.mark.parametrize("policy", [3, None, b"save_nothing", ["save_nothing"]])
def test_wrong_policy_type_raises_type_error(policy):
    """A policy that is neither a name nor a policy object raises TypeError."""
    with pytest.raises(TypeError, match=r"`policy` must be a policy name \(str\), a policy obj"):
        remat(_block, policy=policy)
    with pytest.raises(TypeError, match="`policy` must be"):
        remat(policy=policy)


@pytest.mark.parametrize("policy", [torch.mm, torch.nn.Linear(2, 2)], ids=["function", "module"])
def test_torch_function_or_module_as_policy_raises_at_the_call(policy):
    """A torch function or module passed as ``policy`` raises at ``remat(...)``, not in the
    forward with torch's own error about an ``OpCall`` argument (found by a probe)."""
    with pytest.raises(TypeError, match="a torch function or module, not a policy"):
        remat(_block, policy=policy)


@pytest.mark.parametrize("kind", [staticmethod, classmethod])
def test_remat_above_staticmethod_or_classmethod_raises(kind):
    """``@remat`` above ``@staticmethod`` would bind as a plain method: it raises when
    decorating, naming the order that works (it failed at the call, found by a probe)."""
    with pytest.raises(TypeError, match=f"below `@{kind.__name__}`"):
        remat(kind(_block))


class _Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).tanh()


def _scripted_function(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace.*` is deprecated")
@pytest.mark.parametrize("kind", ["module", "method", "function", "traced"])
def test_torchscript_raises_at_the_call(kind):
    """A TorchScript module, method or function crashed in remat's walk of what ``fn``
    reaches (found by a probe): it raises at ``remat(...)``, saying what works."""
    if kind == "function":
        scripted: object = torch.jit.script(_scripted_function)
    elif kind == "traced":
        scripted = torch.jit.trace(_Scripted(), torch.ones(2, 3))
    else:
        scripted = torch.jit.script(_Scripted())
        scripted = scripted.forward if kind == "method" else scripted
    with pytest.raises(TypeError, match=r"TorchScript .* Apply `remat` to the eager"):
        remat(scripted)


class _HoldsScripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.jit.script(_Scripted())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_torchscript_submodule_raises_at_the_first_call(policy):
    """An eager module with a TorchScript child crashed with a ``KeyError`` in remat's walk
    of its submodules (found by a helper): a ``TypeError`` at the first call names it."""
    model = remat(_HoldsScripted(), policy=policy)
    with pytest.raises(TypeError, match=r"reached TorchScript .*`inner` of _HoldsScripted"):
        model(torch.ones(2, 3, requires_grad=True))


@pytest.mark.parametrize("check", ["full", None, True])
def test_bad_check_raises_value_error(check):
    """A ``check`` other than 'shapes' or 'none' raises ValueError at the call site."""
    message = f"`check` must be 'shapes' or 'none', got {check!r}"
    with pytest.raises(ValueError, match=message):
        remat(_block, check=check)
    with pytest.raises(ValueError, match=message):
        remat(check=check)


@pytest.mark.parametrize("preserve_rng", [1, 0, "yes", None])
def test_non_bool_preserve_rng_raises_type_error(preserve_rng):
    """A non-bool ``preserve_rng`` raises TypeError at the call site."""
    message = f"`preserve_rng` must be True or False, got {preserve_rng!r}"
    with pytest.raises(TypeError, match=message):
        remat(_block, preserve_rng=preserve_rng)
    with pytest.raises(TypeError, match=message):
        remat(preserve_rng=preserve_rng)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_without_autograd_fn_is_simply_called(context, no_regions):
    """Under no_grad/inference_mode, ``fn`` runs once, with no region and no dispatch mode."""
    modes = []

    def fn(x, w):
        modes.append(_get_current_dispatch_mode())
        return _block(x, w)

    x, w = _inputs()
    with context():
        out = remat(fn)(x, w)
        expected = _block(x, w)
    assert modes == [None]
    assert torch.equal(out, expected)
    assert out.grad_fn is None
    assert out.is_inference() == (context is torch.inference_mode)


@pytest.mark.parametrize("policy", ["save_everything", policies.save_everything])
def test_save_everything_is_plain_fn(policy, no_regions):
    """``policy='save_everything'`` builds no region: the autograd graph is plain ``fn``'s."""
    calls = []

    def fn(x, w):
        calls.append(None)
        return _block(x, w)

    wrapped = remat(fn, policy=policy)
    out, grads = _grads(wrapped, *_inputs())
    _assert_same((out, grads), _grads(_block, *_inputs()))
    assert out.grad_fn.name() == "SinBackward0"
    assert len(calls) == 1


_Point = collections.namedtuple("_Point", ["x", "y"])
_CONTAINERS = (
    list,
    tuple,
    lambda c: dict(zip("bca", c, strict=False)),
    lambda c: collections.OrderedDict(zip("bca", c, strict=False)),
    lambda c: collections.defaultdict(int, zip("ba", c, strict=False)),
    collections.deque,
    lambda c: _Point(*[*c, None, None][:2]),
)
_TREES = st.recursive(
    st.sampled_from([None, 1, "s", 2.5]) | st.just(torch.zeros(1)),
    lambda inner: st.tuples(st.sampled_from(_CONTAINERS), st.lists(inner, max_size=3)).map(
        lambda made: made[0](made[1])
    ),
    max_leaves=8,
)


def _containers(tree):
    """``tree``'s containers, in the order a walk first meets them (each once, by identity)."""
    seen = {}

    def walk(node):
        if optree.tree_is_leaf(node, none_is_leaf=True) or id(node) in seen:
            return
        seen[id(node)] = node
        for child in optree.tree_flatten_one_level(node, none_is_leaf=True).children:
            walk(child)

    walk(tree)
    return list(seen.values())


@settings(deadline=None, max_examples=60)
@given(first=_TREES, second=_TREES)
def test_the_recompute_rebuilds_containers_held_twice_as_one(first, second):
    """`_engine.call_plan`: the rebuild is the call, with one container per container."""
    box = [first]
    call = ((box, [box, second], {"again": first}), {"k": second, "t": (second, box)})
    leaves, structure, nodes = _engine.flatten_call(call, "")
    shared = _engine.call_plan(call, leaves, nodes, "", set())
    assert shared is not None
    built = shared.build(leaves, {})
    plain = optree.tree_unflatten(structure, leaves)
    assert optree.tree_structure(built, none_is_leaf=True) == structure
    assert all(map(operator.is_, optree.tree_leaves(built, none_is_leaf=True), leaves))
    assert plain == built
    mine, theirs = _containers(built), _containers(call)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert type(a) is type(b)
        assert a is not b or a == ()  # (the empty tuple is one object)


class _Box:
    """An optree node (namespace "boxes") whose flatten makes a new dict each time."""

    def __init__(self, value):
        self.value = value


optree.register_pytree_node(
    _Box,
    lambda box: ([{"value": box.value}], None, None),
    lambda _, children: _Box(children[0]["value"]),
    namespace="boxes",
)


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_containers_a_flatten_makes_are_not_one_container(policy):
    """Each box's flatten makes a dict that is freed once walked, and the next box's may get
    its address: the rebuild took them for one dict (met twice), and gave each box the first
    box's tensor (other gradients with no error under the default policy)."""

    def fn(boxes, first, second):
        total = sum(scale * box.value for scale, box in zip((2, 3, 5), boxes, strict=True))
        return (total * len(first) * len(second)).sin().exp()

    def grads(f):
        values = [torch.linspace(-1, i, 4, dtype=torch.float64).requires_grad_() for i in range(3)]
        shared = [1.0]
        f([_Box(v) for v in values], shared, shared).sum().backward()
        return [v.grad for v in values]

    expected = grads(fn)
    for got, want in zip(grads(remat(fn, policy=policy, namespace="boxes")), expected, strict=True):
        assert torch.equal(got, want)

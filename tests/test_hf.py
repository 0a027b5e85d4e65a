"""Hugging Face models under `remat.apply`: loss and gradients bitwise equal to plain's.

Each model is a tiny random-init one (no download), called the way a training loop
calls it: ``model(input_ids=ids, labels=ids)`` in train mode, with the config's
``use_cache=True`` left as it is, so the layers must drop the KV cache as Hugging
Face's own checkpointing does. Float32: the MoE experts' grouped matmul has no
float64 kernel on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

import remat
from tests.helpers import POLICIES as EVERY_POLICY

pytest.importorskip("transformers")

from transformers.modeling_layers import GradientCheckpointingLayer

BATCH, SEQ, VOCAB = 2, 16, 128
LR = 0.1
POLICIES = ["save_nothing", "save_matmuls"]


# The Llama-family models' shapes (GPT-2 names them its own way).
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class Case(NamedTuple):
    build: Callable[[], nn.Module]
    layer: type[GradientCheckpointingLayer]


def _llama() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(**SMALL)
    return Case(lambda: LlamaForCausalLM(config), LlamaDecoderLayer)


def _gpt2(attention: str | None = None) -> Case:
    """``attention``: the attention implementation, or None for the default."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=32,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attention,
    )
    return Case(lambda: GPT2LMHeadModel(config), GPT2Block)


def _mixtral() -> Case:
    """Top-2 of 4 experts, with the router's auxiliary loss in ``loss``."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    config = MixtralConfig(
        **SMALL,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    return Case(lambda: MixtralForCausalLM(config), MixtralDecoderLayer)


def _qwen2_moe() -> Case:
    """Top-2 of 4 experts and a shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

    config = Qwen2MoeConfig(
        **SMALL,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return Case(lambda: Qwen2MoeForCausalLM(config), Qwen2MoeDecoderLayer)


def _t5() -> Case:
    """An encoder-decoder. Head dimension 8: there the KV cache changes plain's gradients
    in the last bits (see `test_t5_training_is_plain_without_the_cache`)."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return Case(lambda: T5ForConditionalGeneration(config), T5Block)


CASES = {"llama": _llama, "gpt2": _gpt2, "mixtral": _mixtral, "qwen2_moe": _qwen2_moe}
# T5's layers run their sublayers from a list, which `_layer_calls` cannot hook.
MORE = {"t5": _t5}
# Every model; and every model and policy. GPT-2's base model passes the KV cache to
# its blocks positionally and drops it by its own flag, which `apply` must set too.
NAMES = list(CASES)
NAMES_POLICIES = [(n, p) for n in CASES for p in POLICIES]


def _model(name: str) -> tuple[nn.Module, type[GradientCheckpointingLayer]]:
    """A fresh ``name`` model in train mode, the same weights every time, and its layer class."""
    case = {**CASES, **MORE}[name]()
    torch.manual_seed(0)
    return case.build().train(), case.layer


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def _layer_calls(model: nn.Module, layer: type) -> Iterator[list[int]]:
    """How many times each ``layer``'s body ran (a hook on its first submodule)."""
    layers = [m for m in model.modules() if isinstance(m, layer)]
    calls = [0] * len(layers)

    def counter(i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            calls[i] += 1

        return hook

    handles = [next(m.children()).register_forward_hook(counter(i)) for i, m in enumerate(layers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _train(
    model: nn.Module, steps: int = 2, **call: Any
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``steps`` SGD steps on the default training call (plus ``call``); each step's loss
    and gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, history = _ids(), []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)  # the same dropout masks for every model
        loss = model(input_ids=ids, labels=ids, **call).loss
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        history.append((loss.detach(), grads))
        optimizer.step()
    return history


def _functional_train(model: nn.Module, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """``steps`` SGD steps with `torch.func.grad` of a loss of the parameters; each step's grads."""
    ids = _ids()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}

    def loss(params: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        torch.manual_seed(100 + step)
        return functional_call(model, params, (), {"input_ids": ids, "labels": ids}).loss

    history = []
    for step in range(steps):
        grads = grad(loss)(params, step)
        history.append(grads)
        params = {k: p - LR * grads[k] for k, p in params.items()}
    return history


def _assert_same(plain: Any, other: Any) -> None:
    """Equal structure, and every tensor bitwise equal."""
    if isinstance(plain, torch.Tensor):
        assert torch.equal(plain, other)
    elif isinstance(plain, dict):
        assert plain.keys() == other.keys()
        for key in plain:
            _assert_same(plain[key], other[key])
    else:
        assert len(plain) == len(other)
        for a, b in zip(plain, other, strict=True):
            _assert_same(a, b)


def _held(model: nn.Module) -> int:
    """Bytes the training forward allocates and still holds when it returns (then backward)."""
    ids = _ids()
    torch.manual_seed(100)
    with remat.memory.track() as memory:
        out = model(input_ids=ids, labels=ids)
    held = memory.live
    out.loss.backward()
    return held


def _hf_checkpointing_on(model: Any) -> None:
    """Hugging Face's own checkpointing, by its newer name where the model has it (transformers
    5.23 warns that `gradient_checkpointing_enable` is deprecated; 5.17 has only that name)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()


def _hf_checkpointing_off(model: Any) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None)
    (disable or model.gradient_checkpointing_disable)()


def _cache_keyword() -> str:
    """The name transformers gives the KV cache, as a model forward's keyword and an output's
    field: ``cache`` from transformers 5.24, which deprecates ``past_key_values`` (a
    FutureWarning as a keyword, a logged warning as a field), the only name up to 5.23."""
    from transformers import GPT2LMHeadModel

    names = inspect.signature(GPT2LMHeadModel.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def _cache(out: Any) -> Any:
    """The KV cache a model's call returned."""
    return getattr(out, _cache_keyword())


def _hf_layers_keep_the_cache_without_autograd() -> bool:
    """Whether Hugging Face's layers skip their own checkpointing, and keep the cache, when
    autograd does not record (transformers 5.24; up to 5.23 they look at the mode only)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Probe(GradientCheckpointingLayer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    calls: list[int] = []
    probe: Any = Probe().train()
    probe.gradient_checkpointing = True
    probe._gradient_checkpointing_func = lambda fn, *args: calls.append(1) or fn(*args)
    with torch.no_grad():
        probe(torch.zeros(1))
    return not calls


def _copy(model: nn.Module, how: str) -> nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("train", [_train, _functional_train], ids=["backward", "func.grad"])
@pytest.mark.parametrize(("name", "policy"), NAMES_POLICIES)
def test_training_steps_equal_plain(name, policy, train):
    """Two SGD steps of the default training call, by `.backward()` or by `functional_call`
    under `torch.func.grad`: losses and gradients bitwise plain's."""
    model, layer = _model(name)
    plain = copy.deepcopy(model)
    remat.apply(model, layer, policy=policy)
    with _layer_calls(model, layer) as calls:
        history = train(model)
    _assert_same(train(plain), history)
    assert calls == [4, 4]  # a forward and a recompute per step


@pytest.mark.parametrize("name", [*NAMES, *MORE])
@pytest.mark.parametrize("policy", POLICIES)
def test_drops_the_kv_cache_in_training(name, policy):
    """The training call returns no filled KV cache, as under Hugging Face's checkpointing."""
    model, layer = _model(name)
    remat.apply(model, layer, policy=policy)
    ids = _ids()
    out = model(input_ids=ids, labels=ids)
    cache = _cache(out)
    assert cache is None or cache.get_seq_length() == 0
    out.loss.backward()
    assert cache is None or cache.get_seq_length() == 0


@pytest.mark.parametrize("name", NAMES)
def test_forward_holds_at_most_hf_checkpointing(name):
    """Held after the forward: save_nothing at most HF checkpointing, save_matmuls below plain."""
    model, layer = _model(name)
    hf = copy.deepcopy(model)
    _hf_checkpointing_on(hf)
    plain = _held(copy.deepcopy(model))
    nothing = _held(remat.apply(copy.deepcopy(model), layer, policy="save_nothing"))
    matmuls = _held(remat.apply(copy.deepcopy(model), layer, policy="save_matmuls"))
    assert nothing <= _held(hf)
    assert nothing < matmuls < plain


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("name", list(CASES))
def test_copy_rematerializes_and_trains_alone(name, how):
    """A copy of an applied model recomputes, trains bitwise like plain, and leaves the original."""
    model, layer = _model(name)
    plain = copy.deepcopy(model)
    remat.apply(model, layer)
    copied = _copy(model, how)
    with _layer_calls(copied, layer) as calls:
        history = _train(copied)
    _assert_same(_train(plain), history)
    assert calls == [4, 4]
    assert all(p.grad is not None for p in copied.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_apply_passes_its_options_to_remat_and_none_to_the_layers():
    """Hugging Face calls `remat.checkpoint(partial(forward, ...), *args)`: the options
    must be `checkpoint`'s (torch's names), or they would reach the layer as keywords."""
    model, layer = _model("llama")
    remat.apply(model, layer, policy="save_matmuls", preserve_rng=False, check="none")
    seen = []
    real = remat.remat

    def spy(fn, **options):
        seen.append((fn.keywords.keys() & {"preserve_rng", "check", "policy"}, options))
        return real(fn, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("remat._apply.remat", spy)
        _train(model, steps=1)
    assert seen
    for leaked, options in seen:
        assert leaked == set()
        assert options["preserve_rng"] is False
        assert options["check"] == "none"
        assert repr(options["policy"]) == "save_matmuls"


@pytest.mark.parametrize("name", list(CASES))
def test_unapply_restores_plain(name):
    """After `unapply`, layers run once per step, hold what plain holds, and keep the cache."""
    model, layer = _model(name)
    plain = copy.deepcopy(model)
    remat.unapply(remat.apply(model, layer, policy="save_matmuls"))
    assert not any(m.gradient_checkpointing for m in model.modules() if isinstance(m, layer))
    with _layer_calls(model, layer) as calls:
        history = _train(model)
    _assert_same(_train(plain), history)
    assert calls == [2, 2]
    assert _held(model) == _held(plain)
    ids = _ids()
    assert _cache(model(input_ids=ids)).get_seq_length() == SEQ


def _generate(model: Any, padded: bool = False) -> Any:
    """Greedy decoding of 8 tokens after the first half of `_ids`, with every step's scores;
    ``padded``: the first prompt's first 3 tokens are left padding."""
    prompt = _ids()[:, : SEQ // 2]
    mask = torch.ones_like(prompt)
    if padded:
        mask[0, :3] = 0
    torch.manual_seed(7)  # the same dropout masks in train mode
    return model.generate(
        input_ids=prompt,
        attention_mask=mask,
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )


@pytest.mark.parametrize("where", ["layers", "model"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_generate_equals_plain(name, mode, where):
    """`generate()` after `remat.apply` on the layers or on the whole model, in train mode
    too, with a left-padded prompt: the tokens and every step's scores are bitwise plain's
    (without autograd the layers keep the KV cache). `generate` reads the signature of
    ``model.forward``: on the whole model, a ``(*args, **kwargs)`` one made it build no
    ``position_ids`` from the mask, and GPT-2 generated other tokens (found by a probe)."""
    model, layer = _model(name)
    plain = copy.deepcopy(model)
    remat.apply(model, layer if where == "layers" else None)
    model.train(mode == "train")
    plain.train(mode == "train")
    got, expected = _generate(model, padded=True), _generate(plain, padded=True)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(expected.scores) == 8
    _assert_same(expected.scores, got.scores)


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_hf_checkpointing_generate_in_train_mode_loses_the_context(name):
    """Hugging Face's own checkpointing in train mode without autograd. Up to transformers
    5.23 it drops the KV cache there too: `generate()` scores the first token as plain does
    (the prefill, without the cache: within rounding), and every later one without the
    context (remat's switch does not). From 5.24 its layers, and the ``use_cache`` default,
    look at autograd too: Llama and T5 generate bitwise as plain, while GPT-2's model, which
    passes its blocks no cache by its own flag and the mode alone, still loses the context."""
    model, _ = _model(name)
    plain = copy.deepcopy(model)
    _hf_checkpointing_on(model)
    got, expected = _generate(model), _generate(plain)
    if name != "gpt2" and _hf_layers_keep_the_cache_without_autograd():
        assert torch.equal(got.sequences, expected.sequences)
        _assert_same(expected.scores, got.scores)
        return
    torch.testing.assert_close(got.scores[0], expected.scores[0])
    for a, b in zip(got.scores[1:], expected.scores[1:], strict=True):
        assert not torch.allclose(a, b)


def test_t5_training_is_plain_without_the_cache():
    """T5 under `remat.apply`: two SGD steps bitwise plain's and Hugging Face checkpointing's
    without the cache (the call the layers make in training); plain's default call, which
    fills the cache, gives the same losses and gradients within float32 rounding (bitwise
    on some CPUs, not on others: docs/models.md)."""
    model, layer = _model("t5")
    plain, hf = copy.deepcopy(model), copy.deepcopy(model)
    cached = copy.deepcopy(model)
    _hf_checkpointing_on(hf)
    remat.apply(model, layer)
    history = _train(model)
    _assert_same(_train(plain, use_cache=False), history)
    _assert_same(_train(hf), history)
    torch.testing.assert_close(_train(cached), history)


def _trainer(model: nn.Module, out: Path, **options: Any) -> Any:
    """A Hugging Face `Trainer`: 3 steps of 2 sequences from a synthetic dataset, on the CPU."""
    pytest.importorskip("accelerate", reason="Hugging Face's Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    rows = torch.randint(0, VOCAB, (6, SEQ), generator=torch.Generator().manual_seed(2))
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **options,
    )
    data = [{"input_ids": row, "labels": row} for row in rows]
    return Trainer(model=model, args=args, train_dataset=data)


def _losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _remat_switch(layer: nn.Module) -> bool:
    """Whether ``layer``'s checkpoint function is remat's."""
    func = layer.__dict__.get("_gradient_checkpointing_func")
    return isinstance(func, functools.partial) and func.func is remat.checkpoint


def test_trainer_steps_equal_plain(tmp_path):
    """Three `Trainer` steps after `remat.apply` (and Trainer's checkpointing off): remat
    recomputes each layer, and the losses and weights are bitwise plain's."""
    model, layer = _model("llama")
    plain = copy.deepcopy(model)
    remat.apply(model, layer, policy="save_matmuls")
    trainer = _trainer(model, tmp_path / "remat")
    with _layer_calls(model, layer) as calls:
        trainer.train()
    expected = _trainer(plain, tmp_path / "plain")
    expected.train()
    assert calls == [6, 6]  # a forward and a recompute per step
    assert all(_remat_switch(m) for m in trainer.model.modules() if isinstance(m, layer))
    assert len(_losses(trainer)) == 3
    assert _losses(trainer) == _losses(expected)
    _assert_same(dict(plain.named_parameters()), dict(model.named_parameters()))


def _checkpointing_option() -> str:
    """`TrainingArguments`' name for Hugging Face's checkpointing (5.23 deprecates the old one)."""
    from transformers import TrainingArguments

    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )


def test_trainer_checkpointing_option_after_apply_raises(tmp_path):
    """`Trainer` with Hugging Face's checkpointing on, after `remat.apply`: `train()` raises
    before the first step, rather than train with torch's checkpoint in remat's place."""
    model, layer = _model("llama")
    remat.apply(model, layer)
    trainer = _trainer(model, tmp_path, **{_checkpointing_option(): True})
    option = pytest.raises(RuntimeError, match="leave that option False")
    with _layer_calls(model, layer) as calls, option as error:
        trainer.train()
    assert "the LlamaDecoderLayer layers of this LlamaForCausalLM" in str(error.value)
    assert calls == [0, 0]
    assert all(_remat_switch(m) for m in model.modules() if isinstance(m, layer))


@pytest.mark.parametrize("switch", [_hf_checkpointing_on, _hf_checkpointing_off], ids=["on", "off"])
def test_hf_switch_after_apply_raises_and_changes_nothing(switch):
    """Hugging Face's checkpointing switched on or off after `remat.apply` raises, and
    remat stays; after `remat.unapply`, Hugging Face's switch works."""
    model, layer = _model("gpt2")
    plain = copy.deepcopy(model)
    remat.apply(model, layer)
    with pytest.raises(RuntimeError, match=r"call `remat\.unapply\(model\)` first"):
        switch(model)
    with _layer_calls(model, layer) as calls:
        history = _train(model)
    assert calls == [4, 4]
    _assert_same(_train(plain), history)
    remat.unapply(model)
    _hf_checkpointing_on(model)
    assert not any(_remat_switch(m) for m in model.modules())
    with _layer_calls(model, layer) as calls:
        _train(model)
    assert calls == [4, 4]  # Hugging Face's checkpoint recomputes


def test_hf_switch_on_a_model_above_raises_at_the_next_call():
    """`remat.apply` on GPT-2's base model and Hugging Face's switch on the model above it:
    the next call of a layer raises, until `remat.apply` again."""
    model, layer = _model("gpt2")
    plain = copy.deepcopy(model)
    remat.apply(model.transformer, layer)
    _hf_checkpointing_on(model)
    model.eval()  # Hugging Face's checkpoint does not run, so the error unwinds no checkpoint
    ids = _ids()
    with pytest.raises(RuntimeError, match=r"has since been set to `torch\.utils\.checkpoint"):
        model(input_ids=ids)
    remat.apply(model.transformer, layer)
    model.train()
    with _layer_calls(model, layer) as calls:
        history = _train(model)
    assert calls == [4, 4]
    _assert_same(_train(plain), history)


def _keeps_everything(policy: Any) -> bool:
    """Whether a region under ``policy`` is its function itself (nothing is recomputed)."""
    return bool(remat.remat(abs, policy=policy).policy.keeps_everything)


# Every kind of policy: the ones that recompute, and those under which a region is `fn`.
RECOMPUTING = {k: p for k, p in EVERY_POLICY.items() if not _keeps_everything(p)}
KEEPING = {k: p for k, p in EVERY_POLICY.items() if _keeps_everything(p)}


def _gpt2_regions_around_attention(attention: str, policy: Any) -> tuple[nn.Module, nn.Module]:
    """A GPT-2 with ``attention``, its attention modules under `remat.apply`, and a plain copy."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    torch.manual_seed(0)
    model = _gpt2(attention).build().train()
    plain = copy.deepcopy(model)
    remat.apply(model, GPT2Attention, policy=policy)
    return model, plain


WROTE = r"region around `GPT2Attention.forward` wrote to the Hugging Face cache it was given"


def test_a_frozen_model_drops_the_cache_while_gradients_are_enabled():
    """No parameter requires grad, in train mode, with gradients enabled: plain returns the
    filled cache; apply's switch drops it, as Hugging Face's own does. Under
    ``torch.no_grad()`` plain and apply keep it (Hugging Face's own too, from 5.24)."""
    model, layer = _model("llama")
    model.requires_grad_(False)
    plain, hf = copy.deepcopy(model), copy.deepcopy(model)
    _hf_checkpointing_on(hf)
    remat.apply(model, layer)
    ids = _ids()

    def length(m: nn.Module) -> int:
        cache = _cache(m(input_ids=ids, use_cache=True))
        return 0 if cache is None else cache.get_seq_length()

    assert [length(plain), length(model), length(hf)] == [SEQ, 0, 0]
    with torch.no_grad():
        assert [length(plain), length(model)] == [SEQ, SEQ]
        assert length(hf) == (SEQ if _hf_layers_keep_the_cache_without_autograd() else 0)


@pytest.mark.parametrize("name", NAMES)
def test_training_on_from_a_filled_cache_raises_where_the_layer_drops_it(name):
    """Training on a continuation of a prompt whose cache was filled without autograd: plain
    attends to the prompt; Hugging Face's checkpointing drops the cache in each layer, where
    the model sized its mask for both (a shape error inside attention, or else no context).
    Under `apply` the layer raises first, and says why. (Up to transformers 5.23 the layer
    drops the cache before its ``forward``, where `apply` is, and GPT-2's model before its
    layers: attention's shape error.)"""
    model, layer = _model(name)
    plain = copy.deepcopy(model)
    remat.apply(model, layer)
    prompt, ids = _ids(), _ids().flip(-1)
    for m in (plain, model):
        with torch.no_grad():
            cache = _cache(m(input_ids=prompt, use_cache=True))
        if m is plain:
            m(input_ids=ids, labels=ids, **{_cache_keyword(): cache}).loss.backward()
            assert cache.get_seq_length() == 2 * prompt.shape[-1]
        else:
            refused = (remat.RecomputeError, f"holds {SEQ} positions")
            if name == "gpt2" or not _hf_layers_keep_the_cache_without_autograd():
                refused = (RuntimeError, "must match the size")
            with pytest.raises(refused[0], match=refused[1]):
                m(input_ids=ids, labels=ids, **{_cache_keyword(): cache})


@pytest.mark.parametrize("name", NAMES)
def test_layers_not_applied_fill_the_cache_and_the_applied_one_drops_its_own(name):
    """`apply` on the last layer only, and the training call given an empty cache: the first
    layer fills its part of it, the last drops the cache (its part is empty), and the step is
    plain's (the check of `test_training_on_from_a_filled_cache...` looks at the layer's own
    part)."""
    from transformers import DynamicCache

    model, layer = _model(name)
    plain = copy.deepcopy(model)
    last = [n for n, m in model.named_modules() if isinstance(m, layer)][-1]
    remat.apply(model, lambda path, _: path == last)
    got, expected = (
        _train(m, steps=1, **{_cache_keyword(): DynamicCache(config=m.config)})
        for m in (model, plain)
    )
    _assert_same(expected, got)


WRITERS = [
    pytest.param(attention, policy, id=f"{attention}-{key}")
    for attention in ["eager", "sdpa"]
    for key, policy in RECOMPUTING.items()
]


@pytest.mark.parametrize(("attention", "policy"), WRITERS)
def test_region_that_writes_the_kv_cache_raises_at_its_forward(attention, policy):
    """A region around GPT-2's attention, called with a KV cache while training: one
    `RecomputeError` as its forward returns, never the cache filled twice; without autograd
    or without a cache, it runs as plain."""
    from transformers import DynamicCache

    model, plain = _gpt2_regions_around_attention(attention, policy)
    ids = _ids()
    cache = DynamicCache(config=model.config)
    with pytest.raises(remat.RecomputeError, match=WROTE):
        model(input_ids=ids, labels=ids, **{_cache_keyword(): cache})
    assert [cache.get_seq_length(i) for i in range(2)] == [SEQ, 0]  # the first layer's, once
    with pytest.raises(remat.RecomputeError, match=WROTE):
        model(input_ids=ids, labels=ids)  # the default call makes a cache
    with torch.no_grad():
        cache = _cache(model(input_ids=ids, use_cache=True))
    assert [cache.get_seq_length(i) for i in range(2)] == [SEQ, SEQ]
    _assert_same(_train(plain, use_cache=False), _train(model, use_cache=False))


@pytest.mark.parametrize("policy", KEEPING.values(), ids=list(KEEPING))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_region_that_keeps_everything_writes_the_kv_cache_as_plain(attention, policy):
    """Under a policy that keeps everything the region is its function, which nothing
    recomputes: the call with a KV cache trains as plain and fills the cache once."""
    from transformers import DynamicCache

    model, plain = _gpt2_regions_around_attention(attention, policy)
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    got = _train(model, steps=1, **{_cache_keyword(): caches[0]})
    _assert_same(_train(plain, steps=1, **{_cache_keyword(): caches[1]}), got)
    assert [caches[0].get_seq_length(i) for i in range(2)] == [SEQ, SEQ]


def test_region_that_reads_a_kv_cache_runs():
    """A region given a Hugging Face cache that it only reads: no error, plain's gradient."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0)

    def read(x: torch.Tensor, cache: Any) -> torch.Tensor:
        return (x * cache.layers[0].keys).sin().sum()

    x = torch.randn(1, 2, 3, 4, requires_grad=True)
    (expected,) = torch.autograd.grad(read(x, cache), x)
    (got,) = torch.autograd.grad(remat.remat(read)(x, cache), x)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == 3


class _PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_compiled_steps_equal_compiled_plain_with_no_region_frames(name):
    """``torch.compile`` (aot_eager) of a model whose layers `apply` made regions, three
    steps of other shapes, under a pass-through function mode: the compiled model
    without remat's loss and gradients, bitwise. A layer calls `remat.checkpoint` with a
    new partial; remat's wrapper copied the partial's attributes, which Dynamo cannot
    trace: each region broke the graph and ran as a frame of its own, recompiled per
    layer and shape until the limit, then eagerly (T5's gradients differed), and Llama
    failed under the mode (``arange() received an invalid combination of arguments``)."""
    torch._dynamo.reset()
    plain, _ = _model(name)
    regions, layer = _model(name)
    remat.apply(regions, layer)
    results = []
    for model in (plain, regions):
        compiled, losses = torch.compile(model, backend="aot_eager"), []
        for step, (batch, seq) in enumerate([(2, 10), (2, 12), (3, 7)]):
            generator = torch.Generator().manual_seed(step)
            ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            with _PassThrough():
                loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append((loss.detach(), [p.grad for p in model.parameters()]))
        results.append(losses)
    torch._dynamo.reset()
    _assert_same(*results)


def test_the_compiled_call_kept_for_generation_is_refused_by_a_region_on_the_model():
    """docs/compile.md: the compiled ``__call__`` Hugging Face keeps on a model for
    compiled generation (`get_compiled_call`) is compiled code the model holds: a region
    on the model refuses it, the layers' regions never reach it, and the model trains as
    plain once it is deleted."""
    model, layer = _model("llama")
    model.get_compiled_call(None)  # (compiles at its first call only: none here)
    expected = _train(copy.deepcopy(model))
    _assert_same(expected, _train(remat.apply(copy.deepcopy(model), layer)))
    model.forward = remat.remat(model.forward)  # one region: the whole model
    with pytest.raises(TypeError, match=r"compiled function .*torch\.compile\(remat\(fn\)\)"):
        _train(model)
    del model._compiled_call
    _assert_same(expected, _train(model))

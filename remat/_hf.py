"""Hugging Face transformers: the checkpointing switch `apply` sets. transformers is never
imported here: only looked up, if it is loaded."""

from __future__ import annotations

import sys

import torch

__all__ = ["WHILE_RECORDING", "checkpointing_layer", "switched"]


class _WhileRecording:
    """The value `apply` gives Hugging Face's ``gradient_checkpointing`` flags: true only
    while autograd records.

    Hugging Face reads the flag with ``self.training`` alone, so a model in training mode
    would drop the KV cache under ``torch.no_grad()`` too, and ``generate()`` would lose
    its context (GPT-2's model passes its blocks no cache, and each layer drops the one it
    gets). Without autograd there is nothing to recompute, and the cache is kept.
    """

    __slots__ = ()

    def __bool__(self) -> bool:
        return torch.is_grad_enabled()

    def __repr__(self) -> str:
        return "WHILE_RECORDING"

    def __reduce__(self) -> str:
        return "WHILE_RECORDING"  # copies and pickles are this one object


WHILE_RECORDING = _WhileRecording()


def checkpointing_layer() -> type | None:
    """Hugging Face's layer base class, if transformers is loaded."""
    layers = sys.modules.get("transformers.modeling_layers")
    return getattr(layers, "GradientCheckpointingLayer", None)


def switched(model: torch.nn.Module, matches: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The Hugging Face layers among ``matches``, and the modules above them with the same
    switch (a model drops the KV cache by its own flag: GPT-2 passes it positionally)."""
    layer = checkpointing_layer()
    if layer is None:
        return []
    layers = {id(m) for m in matches if isinstance(m, layer)}
    if not layers:
        return []
    return [
        m
        for m in model.modules()
        if id(m) in layers
        or (hasattr(m, "gradient_checkpointing") and any(id(s) in layers for s in m.modules()))
    ]

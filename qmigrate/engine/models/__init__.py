"""One definition per model family over the shared layers (engine/layers/). `build` turns a
loaded transformers checkpoint into the model the fast runner drives; `unsupported` says
why it cannot (then the engine falls back to the transformers runner)."""

from __future__ import annotations

import importlib

import torch

from qmigrate.engine.layers.mlp import ACTIVATIONS
from qmigrate.engine.layers.norms import RMSNorm
from qmigrate.engine.layers.rotary import tables_for, unsupported_rope
from qmigrate.engine.models.base import DecoderModel, output_head
from qmigrate.hub.shape import ModelShape

# model_type -> module of engine/models/ that builds it
FAMILIES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    "gemma2": "gemma", "gemma3_text": "gemma",
    "phi3": "phi3",
    "mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe",
}


def family(model) -> str | None:
    return FAMILIES.get(getattr(model.config, "model_type", ""))


def unsupported(model, device: torch.device) -> str | None:
    """Why the fast runner cannot run this model, or None when it can."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "")
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of {', '.join(sorted(FAMILIES))}"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"activation {act!r} (the fast runner has {', '.join(ACTIVATIONS)})"
    why = unsupported_rope(cfg)
    if why:
        return why
    head_dim = ModelShape.from_config(cfg).head_dim
    if device.type == "cuda" and (head_dim & (head_dim - 1) or not 16 <= head_dim <= 256):
        return f"head_dim {head_dim} is not a power of two from 16 to 256 (the attention kernels' tiles)"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return f"the checkpoint's module layout is not the one engine/models/{FAMILIES[kind]}.py reads"
    return None


def _module(model):
    return importlib.import_module(f".{FAMILIES[model.config.model_type]}", __name__)


def build(model, layers=None):
    """The DecoderModel of a checkpoint; `layers`: its layers built (and perhaps cut) elsewhere.
    A family's module gives its layers (`decoder_layers`) and, where it has any, the model's
    settings beyond the shared ones (`model_options(config)`)."""
    cfg, base = model.config, model.model
    if layers is None:
        layers = list(decoder_layers(model))
    options = getattr(_module(model), "model_options", None)
    return DecoderModel(base.embed_tokens.weight.detach(), layers, RMSNorm.of(base.norm), output_head(model),
                        max_positions=cfg.max_position_embeddings, **(options(cfg) if options else {}))


def decoder_layers(model):
    """The checkpoint's DecoderLayers one at a time, each built from its module when it is
    asked for (so a module's weights may be made just before and dropped just after)."""
    return _module(model).decoder_layers(model, tables_for(model, model.config.max_position_embeddings))

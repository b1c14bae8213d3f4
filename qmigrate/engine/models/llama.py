"""Llama 2/3 (llama3 rope scaling, tied embeddings), Qwen2/2.5 (q/k/v biases), Qwen3 (q/k
RMSNorm per head, an explicit head_dim) and Mistral (sliding window): one layout, the
differences read from the checkpoint's modules and config."""

from __future__ import annotations

from collections.abc import Iterator

from qmigrate.engine.layers.attention import Attention, layer_windows
from qmigrate.engine.layers.mlp import GatedMLP
from qmigrate.engine.layers.norms import RMSNorm
from qmigrate.engine.models.base import DecoderLayer

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def decoder_layers(model, tables) -> Iterator[DecoderLayer]:
    """Each layer, built from its module when it is asked for; `tables`: tables_for's."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    act = getattr(cfg, "hidden_act", "silu")
    for i, (layer, window) in enumerate(zip(model.model.layers, layer_windows(cfg))):
        rope = tables.get(types[i] if types else None, tables.get(None))
        yield DecoderLayer(RMSNorm.of(layer.input_layernorm), Attention.of(layer.self_attn, cfg, rope, window),
                           RMSNorm.of(layer.post_attention_layernorm), GatedMLP.of(layer.mlp, act))

"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), norms of 1 + weight before
and after attention and MLP, GeGLU, query_pre_attn_scalar for the softmax scale, sliding
windows on the layers their config marks, attention soft-capping (Gemma 2) or q/k norms
(Gemma 3), a RoPE base per layer type (Gemma 3) and final-logit soft-capping."""

from __future__ import annotations

from collections.abc import Iterator

from qmigrate.engine.layers.attention import Attention, layer_windows
from qmigrate.engine.layers.mlp import GatedMLP
from qmigrate.engine.layers.norms import RMSNorm
from qmigrate.engine.models.base import DecoderLayer

MODEL_TYPES = ("gemma2", "gemma3_text")


def model_options(cfg) -> dict:
    """DecoderModel's settings beyond the shared ones: the embeddings' scale, the final soft-cap."""
    return {"embed_scale": cfg.hidden_size ** 0.5,
            "final_softcap": float(getattr(cfg, "final_logit_softcapping", None) or 0.0)}


def decoder_layers(model, tables) -> Iterator[DecoderLayer]:
    """Each layer, built from its module when it is asked for; `tables`: tables_for's."""
    cfg = model.config
    types = cfg.layer_types
    act = getattr(cfg, "hidden_activation", None) or cfg.hidden_act
    for i, (layer, window) in enumerate(zip(model.model.layers, layer_windows(cfg))):
        rope = tables.get(types[i], tables.get(None))
        yield DecoderLayer(
            RMSNorm.of(layer.input_layernorm), Attention.of(layer.self_attn, cfg, rope, window),
            RMSNorm.of(layer.pre_feedforward_layernorm), GatedMLP.of(layer.mlp, act),
            post_attn_norm=RMSNorm.of(layer.post_attention_layernorm),
            post_mlp_norm=RMSNorm.of(layer.post_feedforward_layernorm))

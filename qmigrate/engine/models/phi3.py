"""Phi-3 and Phi-4 (text): q/k/v and gate/up already fused in the checkpoint, LongRoPE
(see layers/rotary.py) and partial rotary (Phi-4-mini rotates 96 of 128 dims)."""

from __future__ import annotations

from collections.abc import Iterator

from qmigrate.engine.layers.attention import Attention, layer_windows
from qmigrate.engine.layers.mlp import GatedMLP
from qmigrate.engine.layers.norms import RMSNorm
from qmigrate.engine.models.base import DecoderLayer

MODEL_TYPES = ("phi3",)


def decoder_layers(model, tables) -> Iterator[DecoderLayer]:
    """Each layer, built from its module when it is asked for; `tables`: tables_for's."""
    cfg = model.config
    (rope,) = tables.values()
    for layer, window in zip(model.model.layers, layer_windows(cfg)):
        yield DecoderLayer(RMSNorm.of(layer.input_layernorm), Attention.of(layer.self_attn, cfg, rope, window),
                           RMSNorm.of(layer.post_attention_layernorm), GatedMLP.of(layer.mlp, cfg.hidden_act))

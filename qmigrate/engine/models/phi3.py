"""Phi-3 and Phi-4 (text): q/k/v and gate/up already fused in the checkpoint, LongRoPE
(see layers/rotary.py) and partial rotary (Phi-4-mini rotates 96 of 128 dims)."""

from __future__ import annotations

from qmigrate.engine.layers.attention import Attention, layer_windows
from qmigrate.engine.layers.mlp import GatedMLP
from qmigrate.engine.layers.norms import RMSNorm
from qmigrate.engine.layers.rotary import tables_for
from qmigrate.engine.models.base import DecoderLayer, DecoderModel, output_head

MODEL_TYPES = ("phi3",)


def build(model) -> DecoderModel:
    cfg, base = model.config, model.model
    max_positions = cfg.max_position_embeddings
    (rope,) = tables_for(model, max_positions).values()
    layers = [DecoderLayer(RMSNorm.of(layer.input_layernorm), Attention.of(layer.self_attn, cfg, rope, window),
                           RMSNorm.of(layer.post_attention_layernorm), GatedMLP.of(layer.mlp, cfg.hidden_act))
              for layer, window in zip(base.layers, layer_windows(cfg))]
    return DecoderModel(base.embed_tokens.weight.detach(), layers, RMSNorm.of(base.norm), output_head(model),
                        max_positions=max_positions)

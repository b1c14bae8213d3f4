"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (shared expert with a sigmoid gate, q/k/v
biases, dense layers where the config says) and Qwen3-MoE (q/k norm). Attention is the
Llama family's; the MLP of each layer is the grouped expert layer (layers/moe.py) or, on a
dense layer, the gated MLP."""

from __future__ import annotations

from collections.abc import Iterator

from qmigrate.engine.layers.attention import Attention, layer_windows
from qmigrate.engine.layers.mlp import GatedMLP
from qmigrate.engine.layers.moe import MoE
from qmigrate.engine.layers.norms import RMSNorm
from qmigrate.engine.models.base import DecoderLayer, DecoderModel

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def decoder_layers(model, tables) -> Iterator[DecoderLayer]:
    """Each layer, built from its module when it is asked for; `tables`: tables_for's."""
    cfg = model.config
    (rope,) = tables.values()
    act = getattr(cfg, "hidden_act", "silu")
    qwen = cfg.model_type != "mixtral"   # Qwen's routers cast their weights to the model dtype
    for layer, window in zip(model.model.layers, layer_windows(cfg)):
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        mlp = MoE.of(block, cfg, act, qwen) if hasattr(block, "experts") else GatedMLP.of(block, act)
        yield DecoderLayer(RMSNorm.of(layer.input_layernorm), Attention.of(layer.self_attn, cfg, rope, window),
                           RMSNorm.of(layer.post_attention_layernorm), mlp)


def active_weight_bytes(model: DecoderModel, batch: int) -> tuple[int, int]:
    """(bytes a decode step of `batch` rows reads, bytes of all weights): every dense weight,
    and of each MoE layer the experts the batch's tokens are expected to hit when routing is
    uniform, E * (1 - (1 - k / E) ** batch)."""
    dense = total = 0

    def size(t):
        return t.numel() * t.element_size()

    dense += size(model.embed) // model.embed.shape[0] * batch + size(model.lm_head.weight)
    total += size(model.embed) + (size(model.lm_head.weight) if model.lm_head.weight is not model.embed else 0)
    active = 0.0
    for layer in model.layers:
        a = layer.attn
        for t in (a.qkv.weight, a.o.weight, layer.input_norm.weight, layer.mlp_norm.weight):
            dense += size(t)
            total += size(t)
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            per_expert = (size(mlp.gate_up) + size(mlp.down)) / mlp.num_experts
            e, k = mlp.num_experts, mlp.top_k
            active += per_expert * e * (1 - (1 - k / e) ** batch)
            total += size(mlp.gate_up) + size(mlp.down)
            rest = [mlp.router.weight] + ([mlp.shared.gate_up.weight, mlp.shared.down.weight,
                                           mlp.shared_gate.weight] if mlp.shared is not None else [])
        else:
            rest = [mlp.gate_up.weight, mlp.down.weight]
        for t in rest:
            dense += size(t)
            total += size(t)
    return int(dense + active), int(total)

"""A decoder-only model as the fast runner runs it: embeddings (optionally scaled), layers,
the final norm and the output head (tied or not, optionally soft-capped). A family file
only says how its checkpoint's modules map onto the shared layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qmigrate.engine.layers.attention import Attention
from qmigrate.engine.layers.linear import Linear
from qmigrate.engine.layers.norms import RMSNorm


@dataclass(slots=True)
class DecoderLayer:
    """Pre-norm attention and MLP with residual adds; `post_*` norms (Gemma) apply to each
    block's output before its residual add. `mlp` is any callable [T, H] -> [T, H]."""
    input_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: object
    post_attn_norm: RMSNorm | None = None
    post_mlp_norm: RMSNorm | None = None

    def __call__(self, h, residual, x, kv, shape, plans):
        if residual is None:
            residual, y = h, self.input_norm(h)
        else:
            y, residual = self.input_norm.add(h, residual)
        h = self.attn(y, x, kv, shape, plans)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        y, residual = self.mlp_norm.add(h, residual)
        h = self.mlp(y)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return h, residual


class DecoderModel:
    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm, lm_head: Linear, *,
                 max_positions: int, embed_scale: float | None = None, final_softcap: float = 0.0):
        self.embed = embed                  # [V, H]
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head              # parallel "vocab"; its weight is `embed` when tied
        self.max_positions = max_positions
        # transformers multiplies by the scale rounded to the model dtype
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale, dtype=embed.dtype,
                                                                          device=embed.device)
        self.final_softcap = final_softcap
        self.device, self.dtype = embed.device, embed.dtype
        self.vocab_size = lm_head.weight.shape[0]
        self.tp = None                      # a tensor-parallel rank's shard: parallel.sharding.shard_model
        self.vocab_rows = range(self.vocab_size)

    def forward(self, x, pool, shape) -> torch.Tensor:
        """logits [R, V] float32 of each row's last token (R = len(x.last))."""
        h = F.embedding(x.ids, self.embed) if self.tp is None else self._embed_shard(x.ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        residual, plans = None, {}
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, x, (pool.kv[i, 0], pool.kv[i, 1]), shape, plans)
        if not shape.is_decode:
            h, residual = h[x.last], residual[x.last]
        y, _ = self.norm.add(h, residual)
        logits = self.lm_head(y).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


    def _embed_shard(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows, zeros for the ids it does not hold,
        summed over the ranks."""
        lo, hi = self.vocab_rows.start, self.vocab_rows.stop
        h = F.embedding((ids - lo).clamp(0, self.embed.shape[0] - 1), self.embed)
        return self.tp.all_reduce(h * ((ids >= lo) & (ids < hi)).unsqueeze(1).to(h.dtype))


def output_head(model) -> Linear:
    head = model.get_output_embeddings()
    return Linear(head.weight.detach(), None if head.bias is None else head.bias.detach(), "vocab")


def quantize_fp8(model: DecoderModel) -> tuple[int, int]:
    """Every layer's projections to e4m3 weights (`Linear.quantize_fp8`): attention's q/k/v and
    output, the MLP's gate/up and down, a mixture's shared expert. The embeddings, norms,
    output head and a mixture's router and routed experts stay as they are. Returns (layers
    quantized, layers whose shape the FP8 matmul cannot take, left as they were)."""
    from qmigrate.engine.layers.mlp import GatedMLP
    from qmigrate.engine.layers.moe import MoE
    linears = []
    for layer in model.layers:
        linears += [layer.attn.qkv, layer.attn.o]
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            mlp = mlp.shared
        if isinstance(mlp, GatedMLP):
            linears += [mlp.gate_up, mlp.down]
    done = sum(lin.quantize_fp8() for lin in linears)
    if done and model.device.type == "cuda":
        torch.cuda.empty_cache()   # the bf16 weights just dropped
    return done, len(linears) - done

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


def quantize_fp8(model: DecoderModel, tune: bool = True) -> tuple[int, int]:
    """Every layer's projections to e4m3 weights (`Linear.quantize_fp8`): attention's q/k/v and
    output, the MLP's gate/up and down, a mixture's shared expert. The embeddings, norms,
    output head and a mixture's router and routed experts stay as they are. On a GPU, `tune`
    times the FP8 matmul's paths for each weight shape (fp8_tune.tune). Returns (layers
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
        if tune:
            from qmigrate.engine import fp8, fp8_tune
            if fp8.triton is not None:
                groups: dict[tuple[int, int], list] = {}
                for lin in linears:
                    if lin.scale is not None:
                        groups.setdefault(tuple(lin.weight.shape), []).append((lin.weight, lin.scale))
                fp8_tune.tune(groups, model.dtype)
                torch.cuda.empty_cache()   # the timings' graphs and outputs
    return done, len(linears) - done


def held_storages(obj) -> dict[int, int]:
    """The storages (data pointer -> bytes) of every tensor a fast-runner model (or any object
    of tensors, lists and attributes) holds, each once."""
    seen: dict[int, int] = {}

    def walk(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x, depth + 1)
        elif depth < 8 and not isinstance(obj, (int, float, str, bool, type(None), torch.device, torch.dtype)):
            names = list(getattr(obj, "__dict__", {})) + [n for c in type(obj).__mro__
                                                          for n in getattr(c, "__slots__", ())]
            for name in names:
                if name != "tp":
                    walk(getattr(obj, name, None), depth + 1)
    walk(obj)
    return seen


def release_unheld(source: torch.nn.Module, built) -> int:
    """Empty every parameter of `source` (the checkpoint's model, handed over) whose storage the
    built model does not hold: the q/k/v and gate/up the build fused into copies, the weights
    FP8 replaced. Returns the bytes released (freed once nothing else holds them)."""
    held = held_storages(built)
    released = 0
    with torch.no_grad():
        for p in source.parameters():
            storage = p.untyped_storage()
            if p.device.type != "meta" and storage.nbytes() and storage.data_ptr() not in held:
                released += storage.nbytes()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return released

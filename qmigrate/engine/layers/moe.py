"""Mixture-of-experts MLP: top-k routing (Mixtral; Qwen's norm_topk_prob), the routed
experts run grouped, and Qwen2-MoE's shared expert behind a sigmoid gate.

Grouped means one GEMM per projection for all experts of a step: assignments are sorted by
expert (`route_blocks`) and a Triton grouped GEMM gives each tile of rows its expert's
weight (kernels/moe_gemm.py), without a host sync, so it runs inside CUDA graphs. Without the
kernels (the CPU) the torch path runs each hit expert's tokens in one matmul, in the order
transformers sums them, which makes it the exact reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qmigrate.engine.kernels import paged_attention as attn
from qmigrate.engine.kernels.tiling import next_pow2
from qmigrate.engine.layers.linear import Linear
from qmigrate.engine.layers.mlp import GatedMLP, act_and_mul

try:
    from qmigrate.engine.kernels.moe_gemm import grouped_gemm_kernel
except ImportError:  # no triton: the torch path only
    grouped_gemm_kernel = None

BLOCK_M = 16


@dataclass(slots=True)
class MoE:
    router: Linear               # [E, H], replicated
    gate_up: torch.Tensor        # [E, 2I, H]: each expert's gate rows, then up rows
    down: torch.Tensor           # [E, H, I]
    top_k: int
    norm_topk_prob: bool
    weights_in_model_dtype: bool  # Qwen casts the routing weights back; Mixtral keeps fp32
    act: str = "silu"
    shared: GatedMLP | None = None
    shared_gate: Linear | None = None   # [1, H]
    tp: object = None            # a tensor-parallel shard's group: the output is a partial sum (parallel/sharding.py)

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, experts = self.route(x)
        if attn.can_use_triton(x) and grouped_gemm_kernel is not None:
            out = self._grouped(x, weights, experts)
        else:
            out = self._per_expert(x, weights, experts)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k] int64) as transformers' top-k routers give them."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return weights, experts

    def _per_expert(self, x, weights, experts) -> torch.Tensor:
        out = torch.zeros_like(x)
        hit = torch.unique(experts).tolist()  # a host sync: the reference path only
        for e in hit:
            token, slot = torch.where(experts == e)
            h = act_and_mul(F.linear(x[token], self.gate_up[e]), self.act)
            h = F.linear(h, self.down[e]) * weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out

    def _grouped(self, x, weights, experts) -> torch.Tensor:
        num_tokens, k = experts.shape
        sorted_ids, tile_expert = route_blocks(experts.flatten(), self.num_experts, BLOCK_M)
        gate_up = grouped_gemm(x, self.gate_up, sorted_ids, tile_expert, num_tokens * k, rows_per_a=k)
        h = act_and_mul(gate_up, self.act)
        out = grouped_gemm(h, self.down, sorted_ids, tile_expert, num_tokens * k, rows_per_a=1,
                           weights=weights.flatten())
        return out.view(num_tokens, k, -1).sum(dim=1)

    @classmethod
    def of(cls, module, cfg, act: str, weights_in_model_dtype: bool) -> "MoE":
        experts = module.experts
        if hasattr(experts, "gate_up_proj"):          # transformers 5: [E, 2I, H] and [E, H, I]
            gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        else:                                         # a list of expert MLPs
            first = experts[0]
            names = ("w1", "w3", "w2") if hasattr(first, "w1") else ("gate_proj", "up_proj", "down_proj")
            gate_up = torch.stack([torch.cat([getattr(m, names[0]).weight, getattr(m, names[1]).weight])
                                   for m in experts]).detach()
            down = torch.stack([getattr(m, names[2]).weight for m in experts]).detach()
        router = module.gate
        shared = getattr(module, "shared_expert", None)
        return cls(Linear(router.weight.detach(), None, "replicated"), gate_up.contiguous(), down.contiguous(),
                   int(getattr(router, "top_k", None) or cfg.num_experts_per_tok),
                   bool(getattr(cfg, "norm_topk_prob", True)), weights_in_model_dtype, act,
                   GatedMLP.of(shared, act) if shared is not None else None,
                   Linear.of(module.shared_expert_gate, parallel="replicated") if shared is not None else None)


def route_blocks(flat_experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments sorted by expert, each expert's run padded to a multiple of block_m.

    flat_experts [A] -> (sorted_ids [P] with A for padding, tile_expert [P / block_m] with -1
    past the last real tile); P = (ceil(A / block_m) + E) * block_m bounds every routing."""
    num_assign = flat_experts.shape[0]
    dev = flat_experts.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    seg_start = ends - padded
    first_of = counts.cumsum(0) - counts
    order = torch.argsort(flat_experts, stable=True)
    expert_sorted = flat_experts[order]
    rank = torch.arange(num_assign, device=dev) - first_of[expert_sorted]
    num_tiles = -(-num_assign // block_m) + num_experts
    sorted_ids = torch.full((num_tiles * block_m,), num_assign, dtype=torch.int64, device=dev)
    sorted_ids[seg_start[expert_sorted] + rank] = order
    tile_start = torch.arange(num_tiles, device=dev) * block_m
    tile_expert = torch.searchsorted(ends, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert


def grouped_gemm(a, b, sorted_ids, tile_expert, num_assign: int, rows_per_a: int, weights=None) -> torch.Tensor:
    """[num_assign, N]: row i is a[i // rows_per_a] @ b[expert of i].T, times weights[i] if given."""
    n, k = b.shape[1], b.shape[2]
    out = torch.empty((num_assign, n), dtype=a.dtype, device=a.device)
    if num_assign == 0:
        return out
    assert a.stride(1) == 1 and b.is_contiguous()
    block_n = 64 if n >= 64 else max(16, next_pow2(n))
    block_k = 64 if k >= 64 else max(16, next_pow2(k))
    grid = (tile_expert.shape[0], -(-n // block_n))
    grouped_gemm_kernel[grid](
        a, b, out, sorted_ids, tile_expert, weights if weights is not None else out, num_assign, n, k,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0), ROWS_PER_A=rows_per_a,
        MUL_WEIGHT=weights is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4)
    return out


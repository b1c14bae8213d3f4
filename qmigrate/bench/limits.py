"""The physical limit of a workload on one GPU, from the model's config and the requests'
lengths (pure: no model is built).

Bytes: each decode step reads the weights once (of a mixture of experts: the dense weights
and the experts a step of that many rows is expected to hit, models/moe.py's uniform-routing
estimate), and each output token reads its sequence's KV so far. The fewest steps are
max(longest output, total output / max_seqs): rows run `max_seqs` at a time at most. FLOPs:
2 per active parameter and token (prompt and output), and the attention's 4 * layers * heads *
head_dim per token and position before it. Time is bytes over the copy bandwidth and FLOPs
over the peak: the limit is the larger of the two (memory and compute always overlapping) or
their sum (never overlapping).

`python -m qmigrate.bench.limits MODEL_DIR --sharegpt 1000 --max-seqs 1024` prints it for
ShareGPT traffic sampled as `qmigrate bench --dataset sharegpt` samples it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

H100_COPY_BYTES_PER_S = 2.86e12   # measured: docs/benchmarks.md
H100_PEAK_FLOPS = 989e12          # H100 SXM dense bf16, the vendor's figure


@dataclass(frozen=True, slots=True)
class Shape:
    """What the limit needs of a decoder's config (bf16 unless dtype_bytes says otherwise)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    tied: bool = False
    dtype_bytes: int = 2

    @classmethod
    def of(cls, config: dict) -> Shape:
        heads = config["num_attention_heads"]
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        return cls(hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate=config["intermediate_size"], vocab=config["vocab_size"], num_experts=experts,
                   top_k=config.get("num_experts_per_tok", 0) if experts else 0,
                   expert_intermediate=(config.get("moe_intermediate_size") or config["intermediate_size"])
                   if experts else 0,
                   tied=bool(config.get("tie_word_embeddings", False)))

    @property
    def attention_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    def dense_params(self) -> int:
        """Parameters every token runs through: attention, a dense MLP or the router, the head."""
        mlp = self.num_experts * self.hidden if self.num_experts else 3 * self.hidden * self.intermediate
        return self.layers * (self.attention_params + mlp) + self.vocab * self.hidden

    def active_params(self) -> int:
        """Parameters one token runs through (its top_k experts)."""
        return self.dense_params() + self.layers * self.top_k * self.expert_params

    def step_weight_bytes(self, rows: int) -> float:
        """Weight bytes a decode step of `rows` rows reads (the embedding rows are negligible)."""
        b = self.dense_params() * self.dtype_bytes
        if self.num_experts:
            e, k = self.num_experts, self.top_k
            b += self.layers * e * (1 - (1 - k / e) ** rows) * self.expert_params * self.dtype_bytes
        return b

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def workload_limit(shape: Shape, requests: list[tuple[int, int]], max_seqs: int,
                   copy_bytes_per_s: float = H100_COPY_BYTES_PER_S, peak_flops: float = H100_PEAK_FLOPS) -> dict:
    """requests: (prompt tokens, output tokens) each. Returns the bytes, FLOPs, both times and
    the output tok/s the limit allows, overlapped and not."""
    total_out = sum(o for _, o in requests)
    steps = max(max(o for _, o in requests), -(-total_out // max_seqs))
    rows = min(max_seqs, len(requests))
    weight_bytes = steps * shape.step_weight_bytes(rows)
    # output token i of a request reads the KV of its prompt and the i outputs before it
    contexts = sum(o * p + o * (o - 1) // 2 for p, o in requests)
    kv_bytes = contexts * shape.kv_bytes_per_token
    tokens = sum(p + o for p, o in requests)
    prompt_contexts = sum(p * (p - 1) // 2 for p, _ in requests)
    attn = 4 * shape.layers * shape.heads * shape.head_dim
    flops = 2 * shape.active_params() * tokens + attn * (contexts + prompt_contexts)
    mem_s, flop_s = (weight_bytes + kv_bytes) / copy_bytes_per_s, flops / peak_flops
    return {"requests": len(requests), "output_tokens": total_out, "steps": steps, "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes, "flops": flops, "memory_s": mem_s, "compute_s": flop_s,
            "tok_per_s_overlapped": total_out / max(mem_s, flop_s),
            "tok_per_s_serial": total_out / (mem_s + flop_s)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="The physical limit of ShareGPT traffic on one GPU.")
    ap.add_argument("model_dir")
    ap.add_argument("--sharegpt", type=int, default=1000, help="requests, sampled as `qmigrate bench` does")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seqs", type=int, default=1024)
    ap.add_argument("--copy-bytes-per-s", type=float, default=H100_COPY_BYTES_PER_S)
    ap.add_argument("--peak-flops", type=float, default=H100_PEAK_FLOPS)
    args = ap.parse_args(argv)
    from qmigrate.bench.sharegpt import ShareGPTWorkload
    reqs = ShareGPTWorkload(args.model_dir, args.sharegpt, args.seed).requests()
    shape = Shape.of(json.loads((Path(args.model_dir) / "config.json").read_text()))
    out = workload_limit(shape, [(len(p), n) for p, n in reqs], args.max_seqs, args.copy_bytes_per_s,
                         args.peak_flops)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""The fast runner for the Llama family (Llama, Mistral, Qwen2 and their derivatives).

The weights come from the loaded transformers checkpoint, with q/k/v and gate/up fused
into one matrix each. A step is one varlen forward over every row's new tokens (no
padding): per layer an RMSNorm fused with the residual add, one q/k/v matmul, RoPE fused
with the write of K and V into the paged pool, attention that reads the pool in place, the
output projection, and the MLP. Steps of decode rows only replay a CUDA graph captured
for the next batch-size bucket. Steps that carry prompt tokens (a prefill, or decode rows
with new prompts among them, as continuous batching runs whenever a request ends while
others wait) replay a graph captured for the next bucket of tokens, with the rows padded
to max_batch: run eagerly, such a step's ~250 launches took 13-22 ms of host time on an
H100 whatever its size, several times what the device needed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import fused, parallel
from . import paged_attention as attn
from .batch import StepBatch
from .kvcache import BlockPool
from .parallel import TensorParallel

log = logging.getLogger(__name__)

FAMILY = ("llama", "mistral", "qwen2")
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Tokens of a step with prompts. Past the last bucket the device time outgrows the host's.
TOKEN_BUCKETS = (64, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)
# Where there are graphs, an eager step with prompts (past the last token bucket) is padded
# to a multiple of this many tokens and its rows to max_batch, so that its matmuls come in a
# few shapes that the warm-up has run. A matmul of a new shape took tens of ms of host time
# on an H100 the first time (cuBLAS chose and loaded a kernel for it), and every burst of
# prompts is a run of steps of new token counts.
EAGER_TOKEN_STEP = 512


def eager_tokens(num_tokens: int, max_tokens: int) -> int:
    """The tokens an eager step with prompts is padded to: the next multiple of
    EAGER_TOKEN_STEP, never past max_tokens (nor below num_tokens)."""
    step = EAGER_TOKEN_STEP
    return max(num_tokens, min(-(-num_tokens // step) * step, max_tokens))


def eager_sizes(last_bucket: int, max_tokens: int) -> list[int]:
    """Every padded token count of a step past the last token bucket, up to max_tokens."""
    if max_tokens <= last_bucket:
        return []
    step = EAGER_TOKEN_STEP
    return list(range((last_bucket // step + 1) * step, max_tokens, step)) + [max_tokens]


def unsupported(model, device: torch.device) -> str | None:
    """Why the fast runner cannot run this model, or None when it can."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "")
    if kind not in FAMILY:
        return f"model type {kind!r} is not one of {', '.join(FAMILY)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (the fast runner has SiLU only)"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        return f"sliding-window attention ({window} of {cfg.max_position_embeddings} positions)"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if device.type == "cuda" and head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "the checkpoint's module layout is not the Llama one"
    return None


@dataclass(slots=True)
class Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _cat(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.weight.shape[0])
                      for m, b in zip(linears, biases)])
    return weight, bias


def _bias(m) -> torch.Tensor | None:
    return None if m.bias is None else m.bias.detach()


@dataclass(slots=True)
class _Inputs:
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    last: torch.Tensor


class LlamaRunner:
    name = "fast"

    def __init__(self, model, *, max_batch: int = 256, max_tokens: int = 8192, cuda_graphs: bool = True,
                 tp: TensorParallel | None = None):
        cfg = model.config
        base = model.model
        first = base.layers[0]
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = float(getattr(first.self_attn, "scaling", self.head_dim ** -0.5))
        self.eps = float(first.input_layernorm.variance_epsilon)
        self.tp = tp
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        if tp is None:
            self._take_weights(model)
        else:
            self._take_shards(model, tp)
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.cos, self.sin = fused.rope_tables(base.rotary_emb, cfg.max_position_embeddings)
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)
        self.max_batch = max_batch
        self.use_kernels = attn.can_use_triton(self.embed)
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}         # decode steps, by rows
        self.token_graphs: dict[int, torch.cuda.CUDAGraph] = {}   # steps with prompts, by tokens
        self.token_buckets = [t for t in TOKEN_BUCKETS if t < max_tokens] + [min(max_tokens, TOKEN_BUCKETS[-1])]
        self.max_tokens = max_tokens
        self.pool: BlockPool | None = None

    def _take_weights(self, model) -> None:
        """The checkpoint's tensors, where they are (q/k/v and gate/up fused into new ones)."""
        base = model.model
        self.embed = base.embed_tokens.weight.detach()
        self.norm = base.norm.weight.detach()
        self.lm_head = model.get_output_embeddings().weight.detach()
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            qkv, qkv_bias = _cat(a.q_proj, a.k_proj, a.v_proj)
            gate_up, gate_up_bias = _cat(m.gate_proj, m.up_proj)
            self.layers.append(Layer(layer.input_layernorm.weight.detach(), qkv, qkv_bias,
                                     a.o_proj.weight.detach(), _bias(a.o_proj),
                                     layer.post_attention_layernorm.weight.detach(), gate_up, gate_up_bias,
                                     m.down_proj.weight.detach(), _bias(m.down_proj)))

    def _take_shards(self, model, tp: TensorParallel) -> None:
        """This rank's shards of the checkpoint (loaded on the CPU), moved to tp.device."""
        cfg, base, r, n, dev = model.config, model.model, tp.rank, tp.world, tp.device
        layout = tp.layout = parallel.check_layout(n, self.num_heads, self.num_kv_heads,
                                                   base.layers[0].mlp.gate_proj.weight.shape[0])
        qkv_rows = parallel.qkv_ranges(layout, r, self.head_dim)
        qkv_parts = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        to = lambda t: None if t is None else t.detach().contiguous().to(dev)
        self.embed = to(parallel.split_vocab(base.embed_tokens.weight.detach(), r, n))
        self.vocab_rows = parallel.vocab_range(self.vocab_size, r, n)
        self.norm = to(base.norm.weight)
        self.lm_head = to(parallel.split_vocab(model.get_output_embeddings().weight.detach(), r, n))
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            qkv, qkv_bias = _cat(a.q_proj, a.k_proj, a.v_proj)
            gate_up, gate_up_bias = _cat(m.gate_proj, m.up_proj)
            inter = m.gate_proj.weight.shape[0]
            gu_rows = parallel.even_ranges([inter, inter], r, n)
            lead = r == 0   # a row-parallel bias is added once, before the sum
            self.layers.append(Layer(
                to(layer.input_layernorm.weight),
                to(parallel.split_parts(qkv, qkv_parts, qkv_rows)),
                to(parallel.split_parts(qkv_bias, qkv_parts, qkv_rows)),
                to(parallel.split_cols(a.o_proj.weight.detach(), r, n)), to(_bias(a.o_proj)) if lead else None,
                to(layer.post_attention_layernorm.weight),
                to(parallel.split_parts(gate_up, [inter, inter], gu_rows)),
                to(parallel.split_parts(gate_up_bias, [inter, inter], gu_rows)),
                to(parallel.split_cols(m.down_proj.weight.detach(), r, n)),
                to(_bias(m.down_proj)) if lead else None))
        self.num_heads, self.num_kv_heads = layout.heads_per_rank, layout.kv_heads_per_rank

    # --- setup -------------------------------------------------------------------------
    def attach(self, pool: BlockPool | None, capture: bool = True) -> None:
        self.pool = pool
        self.graphs.clear()
        self.token_graphs.clear()
        if pool is not None and capture and self.use_graphs:
            self._capture()

    def _capture(self) -> None:
        self._alloc_static()
        n = self.max_batch
        buckets = [b for b in GRAPH_BUCKETS if b < n] + [n]
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Largest first, all in one memory pool: a smaller capture reuses the larger's
        # blocks, which is safe as graphs replay one at a time and write their logits out.
        with torch.cuda.stream(stream), torch.inference_mode():
            for tokens in reversed(self.token_buckets):
                self.token_graphs[tokens] = self._captured(lambda: self._tokens_into(tokens), mempool, stream)
            for b in reversed(buckets):
                self.graphs[b] = self._captured(lambda: self._decode_into(b), mempool, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured graphs for decode steps of %s rows and for steps of up to %s tokens",
                 buckets, self.token_buckets)

    def _alloc_static(self) -> None:
        """The graphs' input and output buffers (they are read and written in place)."""
        pool, n = self.pool, self.max_batch
        width = pool.blocks_for(self.cos.shape[0])
        dev = self.device
        num_tokens = max(n, self.token_buckets[-1])
        self.static = _Inputs(
            ids=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            positions=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            slots=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            query_start=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            block_table=torch.zeros((n, width), dtype=torch.int32, device=dev),
            last=torch.arange(n, dtype=torch.int64, device=dev))
        # Steps with prompts have rows of any length: their own row layout, padded with rows of
        # no tokens (they get no attention tiles, and their logits are not read).
        self.static_rows = (torch.zeros(n + 1, dtype=torch.int32, device=dev),
                            torch.zeros(n, dtype=torch.int64, device=dev))
        self.static_logits = torch.empty((n, self.vocab_size), dtype=torch.float32, device=dev)

    @staticmethod
    def _captured(run, mempool, stream) -> torch.cuda.CUDAGraph:
        for _ in range(2):  # compile the kernels outside the capture
            run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool, stream=stream):
            run()
        return graph

    def _decode_into(self, b: int) -> None:
        s = self.static
        view = _Inputs(s.ids[:b], s.positions[:b], s.slots[:b], s.query_start[:b + 1], s.seq_lens[:b],
                       s.block_table[:b], s.last[:b])
        self.static_logits[:b] = self._forward(view, b, 1, is_decode=True)

    def _tokens_into(self, tokens: int) -> None:
        """A step of up to `tokens` tokens in up to max_batch rows, planned for a row as long
        as the bucket (any real row is no longer)."""
        s, (query_start, last), n = self.static, self.static_rows, self.max_batch
        view = _Inputs(s.ids[:tokens], s.positions[:tokens], s.slots[:tokens], query_start, s.seq_lens,
                       s.block_table, last)
        self.static_logits[:n] = self._forward(view, tokens, tokens, is_decode=False)

    # --- a step ------------------------------------------------------------------------
    can_feed = True

    def forward(self, batch: StepBatch, feed=None) -> torch.Tensor:
        """logits [B, V] float32 of each row's last token. `feed` = (rows, src, tokens): the
        input of row rows[k] (a decode row) is tokens[src[k]], a tensor already on the device."""
        b, t = batch.num_rows, batch.num_tokens
        if batch.is_decode and self.graphs and b <= self.max_batch:
            bucket = next(k for k in sorted(self.graphs) if k >= b)
            self._load_static(batch, bucket)
            graph = self.graphs[bucket]
        elif self.token_graphs and b <= self.max_batch and t <= self.token_buckets[-1]:
            bucket = next(k for k in self.token_buckets if k >= t)
            self._load_tokens(batch, bucket)
            graph = self.token_graphs[bucket]
        else:
            padded = bool(self.token_graphs) and not batch.is_decode
            x = self._inputs(batch, self.eager_tokens(t) if padded else t, max(b, self.max_batch) if padded else b)
            if feed is not None:
                self._feed(x.ids, batch, feed)
            return self._forward(x, x.ids.shape[0], batch.max_query_len, batch.is_decode)[:b]
        if feed is not None:
            self._feed(self.static.ids, batch, feed)
        graph.replay()
        return self.static_logits[:b]

    def eager_tokens(self, num_tokens: int) -> int:
        return eager_tokens(num_tokens, self.max_tokens)

    def eager_sizes(self) -> list[int]:
        """Every token count an eager step with prompts is padded to (none without graphs:
        then nothing is padded)."""
        return eager_sizes(self.token_buckets[-1], self.max_tokens) if self.token_graphs else []

    def _feed(self, ids: torch.Tensor, batch: StepBatch, feed) -> None:
        rows, src, tokens = feed
        at = torch.as_tensor(batch.query_start[rows], dtype=torch.int64).to(self.device, non_blocking=True)
        src = torch.as_tensor(src, dtype=torch.int64).to(self.device, non_blocking=True)
        ids.index_copy_(0, at, tokens.index_select(0, src))

    def _inputs(self, batch: StepBatch, num_tokens: int | None = None, num_last: int | None = None) -> _Inputs:
        """The batch's arrays on the device, through pinned buffers: a copy from pageable
        memory larger than the driver's staging buffer (a prefill's ids and slots) makes the
        host wait for the step in flight, so the next step could not be built meanwhile.

        Padded to `num_tokens` tokens (the padding tokens belong to no row and write no KV)
        and to `num_last` logits rows (the padding ones are the first token's again)."""
        dev, pin = self.device, self.device.type == "cuda"
        pad = (num_tokens or batch.num_tokens) - batch.num_tokens
        pad_last = (num_last or batch.num_rows) - batch.num_rows

        def t(a, dtype, extra=0, value=0):
            a = np.ascontiguousarray(a, dtype=dtype)
            host = torch.from_numpy(np.pad(a, (0, extra), constant_values=value) if extra else a)
            return (host.pin_memory() if pin else host).to(dev, non_blocking=True)
        return _Inputs(t(batch.ids, np.int64, pad), t(batch.positions, np.int64, pad),
                       t(batch.slot_mapping, np.int64, pad, -1), t(batch.query_start, np.int32),
                       t(batch.seq_lens, np.int32), t(batch.block_table, np.int32),
                       t(batch.last, np.int64, pad_last))

    def _load_rows(self, batch: StepBatch) -> None:
        """What both kinds of graph read in place: each token's id, position and slot, and
        each row's length and blocks."""
        s, b, n = self.static, batch.num_rows, batch.num_tokens
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        s.ids[:n].copy_(t(batch.ids), non_blocking=True)
        s.positions[:n].copy_(t(batch.positions), non_blocking=True)
        s.slots[:n].copy_(t(batch.slot_mapping), non_blocking=True)
        s.seq_lens[:b].copy_(t(batch.seq_lens), non_blocking=True)
        s.block_table[:b, :batch.block_table.shape[1]].copy_(t(batch.block_table), non_blocking=True)

    def _load_static(self, batch: StepBatch, bucket: int) -> None:
        s, b = self.static, batch.num_rows
        self._load_rows(batch)
        if bucket > b:  # padding rows: write nothing, attend to the zero block
            s.slots[b:bucket].fill_(-1)
            s.seq_lens[b:bucket].fill_(1)
            s.block_table[b:bucket, 0].fill_(0)

    def _load_tokens(self, batch: StepBatch, bucket: int) -> None:
        """The static inputs of a token-bucket graph: the batch's tokens, then padding tokens
        that write nothing and belong to no row; its rows, then rows of no tokens."""
        s, (query_start, last) = self.static, self.static_rows
        b, n = batch.num_rows, batch.num_tokens
        self._load_rows(batch)
        s.slots[n:bucket].fill_(-1)
        s.positions[n:bucket].fill_(0)
        query_start[:b + 1].copy_(torch.from_numpy(np.ascontiguousarray(batch.query_start)), non_blocking=True)
        query_start[b + 1:].fill_(n)
        last[:b].copy_(torch.from_numpy(batch.last.astype(np.int64)), non_blocking=True)
        last[b:].fill_(0)
        s.seq_lens[b:].fill_(1)

    def _forward(self, x: _Inputs, num_tokens: int, max_query_len: int, is_decode: bool) -> torch.Tensor:
        pool, tp = self.pool, self.tp
        h = F.embedding(x.ids, self.embed) if tp is None else self._embed_shard(x.ids)
        residual = None
        plan = None
        if self.use_kernels and not is_decode:
            plan = attn.prefill_plan(x.query_start, num_tokens, max_query_len, self.num_heads,
                                     self.num_kv_heads, self.head_dim)
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual, y = h, fused.rms_norm(h, layer.ln1, self.eps)
            else:
                y, residual = fused.add_rms_norm(h, residual, layer.ln1, self.eps)
            qkv = F.linear(y, layer.qkv, layer.qkv_bias)
            k_cache, v_cache = pool.kv[i, 0], pool.kv[i, 1]
            q = fused.rope_and_write_kv(qkv, x.positions, self.cos, self.sin, k_cache, v_cache, x.slots,
                                        self.num_heads, self.num_kv_heads, self.head_dim)
            if not self.use_kernels:
                o = attn.paged_attention_reference(q, k_cache, v_cache, x.query_start, x.seq_lens,
                                                   x.block_table, self.scale)
            elif is_decode:
                o = attn.decode_attention(q, k_cache, v_cache, x.seq_lens, x.block_table, self.scale)
            else:
                o = attn.prefill_attention(q, k_cache, v_cache, x.query_start, x.seq_lens, x.block_table,
                                           self.scale, max_query_len, plan=plan)
            h = F.linear(o.reshape(num_tokens, -1), layer.o, layer.o_bias)
            if tp is not None:
                h = tp.all_reduce(h)
            y, residual = fused.add_rms_norm(h, residual, layer.ln2, self.eps)
            h = F.linear(fused.silu_and_mul(F.linear(y, layer.gate_up, layer.gate_up_bias)),
                         layer.down, layer.down_bias)
            if tp is not None:
                h = tp.all_reduce(h)
        if not is_decode:
            h, residual = h[x.last], residual[x.last]
        y, _ = fused.add_rms_norm(h, residual, self.norm, self.eps)
        if tp is not None:
            return tp.all_gather_last(F.linear(y, self.lm_head).float())[:, :self.vocab_size]
        return F.linear(y, self.lm_head).float()

    def _embed_shard(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows, zeros for ids it does not hold, summed
        over the ranks."""
        lo, hi = self.vocab_rows.start, self.vocab_rows.stop
        mine = (ids >= lo) & (ids < hi)
        h = F.embedding((ids - lo).clamp(0, self.embed.shape[0] - 1), self.embed)
        return self.tp.all_reduce(h * mine.unsqueeze(1).to(h.dtype))

"""The shared fast runner: static buffers, padding, CUDA graph capture and input staging,
apart from any model's maths (engine/models/ defines those).

A step is one varlen forward over every row's new tokens (no padding) through the model's
`forward(inputs, pool, shape)`. Steps of decode rows only replay a CUDA graph captured for
the next batch-size bucket. Steps that carry prompt tokens (a prefill, or decode rows with
new prompts among them, as continuous batching runs whenever a request ends while others
wait) replay a graph captured for the next bucket of tokens, with the rows padded to
max_batch: run eagerly, such a step's ~250 launches cost more host time than the device
needs for the step, whatever its size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from qmigrate.engine.kernels import paged_attention as attn
from qmigrate.engine.kernels import shared_prefix
from qmigrate.engine.batch import StepBatch
from qmigrate.engine.kv.pool import BlockPool

log = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768,
                 896, 1024)
# Tokens of a step with prompts. Past the last bucket the device time outgrows the host's.
TOKEN_BUCKETS = (64, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)
# Where there are graphs, an eager step with prompts (past the last token bucket) is padded
# to a multiple of this many tokens and its rows to max_batch, so that its matmuls come in a
# few shapes that the warm-up has run. A matmul of a new shape costs far more host time the
# first time (cuBLAS chooses and loads a kernel for it), and every burst of prompts is a run
# of steps of new token counts.
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


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a model's forward needs to know of a step beyond its arrays."""
    num_tokens: int
    max_query_len: int      # a bound on the longest row (a graph plans for its bucket)
    is_decode: bool
    use_kernels: bool       # Triton kernels (CUDA or the interpreter), else the torch reference


@dataclass(slots=True)
class StepInputs:
    """A step's arrays on the device (see batch.StepBatch); the graphs' static buffers are one."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    last: torch.Tensor
    shared: shared_prefix.Shared | None = None   # decode rows grouped by a shared prefix


class GraphRunner:
    """The fast runner: a model's step maths (models/) driven over the paged pool, with the
    inputs staged into static buffers and steps replayed from CUDA graphs."""

    name = "fast"

    def __init__(self, model, *, max_batch: int = 256, max_tokens: int = 8192, cuda_graphs: bool = True,
                 shared_prefix_attention: bool = True):
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.max_positions = model.max_positions
        self.vocab_size = model.vocab_size
        self.max_batch = max_batch
        self.use_kernels = attn.can_use_triton(model.embed) and all(
            attn.supports_head_dim(layer.attn.head_dim) for layer in model.layers)
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}         # decode steps, by rows
        self.shared_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the same with shared prefixes read once
        self.token_graphs: dict[int, torch.cuda.CUDAGraph] = {}   # steps with prompts, by tokens
        self.token_buckets = [t for t in TOKEN_BUCKETS if t < max_tokens] + [min(max_tokens, TOKEN_BUCKETS[-1])]
        self.max_tokens = max_tokens
        self.pool: BlockPool | None = None
        self.shared_prefix_attention = shared_prefix_attention
        self.step_groups: shared_prefix.StepGroups | None = None   # set by attach where rows can share
        first = model.layers[0].attn if model.layers else None
        self.rows_per_group = (shared_prefix.rows_per_group(first.num_heads, first.num_kv_heads, first.head_dim)
                               if first is not None else 1)

    # --- setup -------------------------------------------------------------------------
    def attach(self, pool: BlockPool | None, capture: bool = True) -> None:
        self.pool = pool
        self.graphs.clear()
        self.shared_graphs.clear()
        self.token_graphs.clear()
        # group decode rows by the blocks they share: only a caching pool shares blocks
        shares = self.shared_prefix_attention and self.use_kernels and pool is not None and pool.is_caching
        self.step_groups = shared_prefix.StepGroups(pool.block_size, self.rows_per_group) if shares else None
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
                if self.share_prefixes:
                    self.shared_graphs[b] = self._captured(lambda: self._decode_into(b, shared=True), mempool,
                                                           stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured graphs for decode steps of %s rows and for steps of up to %s tokens",
                 buckets, self.token_buckets)

    def _alloc_static(self) -> None:
        """The graphs' input and output buffers (they are read and written in place)."""
        pool, n = self.pool, self.max_batch
        width = pool.blocks_for(self.max_positions)
        dev = self.device
        num_tokens = max(n, self.token_buckets[-1])
        self.static = StepInputs(
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
        groups = shared_prefix.max_groups(n)
        self.static_shared = shared_prefix.Shared(
            torch.zeros(n, dtype=torch.int32, device=dev),
            torch.full((groups, self.rows_per_group), -1, dtype=torch.int32, device=dev),
            torch.zeros(groups, dtype=torch.int32, device=dev))

    @staticmethod
    def _captured(run, mempool, stream) -> torch.cuda.CUDAGraph:
        for _ in range(2):  # compile the kernels outside the capture
            run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool, stream=stream):
            run()
        return graph

    def _decode_into(self, b: int, shared: bool = False) -> None:
        s, g = self.static, self.static_shared
        groups = shared_prefix.max_groups(b)
        view = StepInputs(s.ids[:b], s.positions[:b], s.slots[:b], s.query_start[:b + 1], s.seq_lens[:b],
                       s.block_table[:b], s.last[:b],
                       shared_prefix.Shared(g.row_start[:b], g.group_rows[:groups], g.group_len[:groups])
                       if shared else None)
        self.static_logits[:b] = self._forward(view, b, 1, is_decode=True)

    def _tokens_into(self, tokens: int) -> None:
        """A step of up to `tokens` tokens in up to max_batch rows, planned for a row as long
        as the bucket (any real row is no longer)."""
        s, (query_start, last), n = self.static, self.static_rows, self.max_batch
        view = StepInputs(s.ids[:tokens], s.positions[:tokens], s.slots[:tokens], query_start, s.seq_lens,
                       s.block_table, last)
        self.static_logits[:n] = self._forward(view, tokens, tokens, is_decode=False)

    # --- a step ------------------------------------------------------------------------
    can_feed = True

    def forward(self, batch: StepBatch, feed=None) -> torch.Tensor:
        """logits [B, V] float32 of each row's last token. `feed` = (rows, src, tokens): the
        input of row rows[k] (a decode row) is tokens[src[k]], a tensor already on the device."""
        b, t = batch.num_rows, batch.num_tokens
        groups = self._groups(batch)
        if batch.is_decode and self.graphs and b <= self.max_batch:
            bucket = next(k for k in sorted(self.graphs) if k >= b)
            self._load_static(batch, bucket)
            if groups is not None:
                self._load_groups(groups, b, bucket)
            graph = (self.graphs if groups is None else self.shared_graphs)[bucket]
        elif self.token_graphs and b <= self.max_batch and t <= self.token_buckets[-1]:
            bucket = next(k for k in self.token_buckets if k >= t)
            self._load_tokens(batch, bucket)
            graph = self.token_graphs[bucket]
        else:
            padded = bool(self.token_graphs) and not batch.is_decode
            x = self._inputs(batch, self.eager_tokens(t) if padded else t, max(b, self.max_batch) if padded else b)
            if groups is not None:
                x.shared = shared_prefix.to_device(groups, self.device)
            if feed is not None:
                self._feed(x.ids, batch, feed)
            return self._forward(x, x.ids.shape[0], batch.max_query_len, batch.is_decode)[:b]
        if feed is not None:
            self._feed(self.static.ids, batch, feed)
        graph.replay()
        return self.static_logits[:b]

    def forward_all(self, batch: StepBatch) -> torch.Tensor:
        """logits [T, V] float32 of every token of the batch, eagerly (prompt logprobs)."""
        x = self._inputs(batch)
        x.last = torch.arange(batch.num_tokens, dtype=torch.int64, device=self.device)
        return self._forward(x, batch.num_tokens, batch.max_query_len, batch.is_decode)

    @property
    def share_prefixes(self) -> bool:
        return self.step_groups is not None

    def _groups(self, batch: StepBatch):
        """A decode step's rows grouped by the prefix blocks they share (None: no group)."""
        if not (self.share_prefixes and batch.is_decode):
            return None
        return self.step_groups(batch.seq_ids, batch.block_table, batch.seq_lens)

    def _load_groups(self, groups, b: int, bucket: int) -> None:
        """The shared-prefix graph's group inputs; padding rows and unused slots share nothing."""
        row_start, group_rows, group_len = groups
        g, n, slots = self.static_shared, len(group_len), shared_prefix.max_groups(bucket)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        g.row_start[:b].copy_(t(row_start), non_blocking=True)
        g.row_start[b:bucket].fill_(0)
        g.group_rows[:n].copy_(t(group_rows), non_blocking=True)
        g.group_len[:n].copy_(t(group_len), non_blocking=True)
        g.group_len[n:slots].fill_(0)

    def eager_tokens(self, num_tokens: int) -> int:
        return eager_tokens(num_tokens, self.max_tokens)

    def eager_sizes(self) -> list[int]:
        """Every token count an eager step with prompts is padded to (none without graphs:
        then nothing is padded)."""
        return eager_sizes(self.token_buckets[-1], self.max_tokens) if self.token_graphs else []

    def export_kv(self, seq_id: int, num_tokens: int | None = None, start: int = 0) -> tuple[torch.Tensor, object]:
        return self.pool.export_started(seq_id, num_tokens, start)

    def import_kv(self, seq_id: int, kv: torch.Tensor, protect=frozenset(), start: int = 0) -> bool:
        return self.pool.load(seq_id, kv, protect, start)

    def _feed(self, ids: torch.Tensor, batch: StepBatch, feed) -> None:
        rows, src, tokens = feed
        at = torch.as_tensor(batch.query_start[rows], dtype=torch.int64).to(self.device, non_blocking=True)
        src = torch.as_tensor(src, dtype=torch.int64).to(self.device, non_blocking=True)
        ids.index_copy_(0, at, tokens.index_select(0, src))

    def _inputs(self, batch: StepBatch, num_tokens: int | None = None, num_last: int | None = None) -> StepInputs:
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
        return StepInputs(t(batch.ids, np.int64, pad), t(batch.positions, np.int64, pad),
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

    def _forward(self, x: StepInputs, num_tokens: int, max_query_len: int, is_decode: bool) -> torch.Tensor:
        return self.model.forward(x, self.pool, StepShape(num_tokens, max_query_len, is_decode, self.use_kernels))

"""The portable runner: any transformers causal LM, over the paged pool.

Decode rows run together in one forward; prefill rows are grouped by length so padding
stays small. The model's attention layers call the cache's `update(...)` once per
layer: `PagedView` writes the step's keys and values into the pool and hands back each
row's past gathered from its blocks (a copy; the fast runner reads the pool in place).
Works for every architecture whose layers take a prepared 4D mask (Llama, Mistral,
Qwen2, Phi, Gemma, ...), on any device.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from qmigrate.engine.runners.hf_attention import install as install_attention
from qmigrate.engine.batch import StepBatch
from qmigrate.engine.kv.pool import BlockPool, write_kv


class PagedView:
    """Handed to a transformers model as its cache (`cache`, or `past_key_values` before
    transformers renamed it) for one forward."""

    is_compileable = False

    def __init__(self, pool: BlockPool, table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 slots: torch.Tensor, total_len: int, is_decode: bool):
        self.pool, self.table = pool, table             # table: [g, W] block ids
        self.rows, self.cols, self.slots = rows, cols, slots  # real tokens of the padded input
        self.total_len, self.is_decode = total_len, is_decode

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        pool = self.pool
        k_pool, v_pool = pool.kv[layer_idx, 0], pool.kv[layer_idx, 1]   # [N, bs, H, D]
        if self.is_decode:
            k_new, v_new = key_states[:, :, 0], value_states[:, :, 0]       # [g, H, D]
        else:
            k_new = key_states.transpose(1, 2)[self.rows, self.cols]        # [T, H, D]
            v_new = value_states.transpose(1, 2)[self.rows, self.cols]
        write_kv(k_pool, v_pool, self.slots, k_new, v_new)
        g, n = self.table.shape[0], self.total_len
        # [g, W, bs, H, D] -> [g, H, n, D]; padding entries read the zero block
        k = k_pool[self.table].view(g, -1, pool.num_kv_heads, pool.head_dim)[:, :n].transpose(1, 2)
        v = v_pool[self.table].view(g, -1, pool.num_kv_heads, pool.head_dim)[:, :n].transpose(1, 2)
        return k.to(key_states.dtype), v.to(value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.total_len


class HFRunner:
    name = "hf"
    can_feed = False

    def __init__(self, model, *, max_padding: float = 0.25, grouped_attention: bool = True):
        self.model = model
        if grouped_attention:
            install_attention(model)
        self.base = getattr(model, model.base_model_prefix)
        self.cache_arg = cache_argument(self.base)
        self.lm_head = model.get_output_embeddings()
        # Gemma 2 and 3 cap their logits in the causal-LM head's forward, which is not run here
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.final_softcap = getattr(text, "final_logit_softcapping", None)
        self.max_padding = max_padding
        self.pool: BlockPool | None = None
        param = next(model.parameters())
        self.device = param.device

    def attach(self, pool: BlockPool | None, capture: bool = True) -> None:
        self.pool = pool

    def eager_sizes(self) -> list[int]:
        return []

    def export_kv(self, seq_id: int, num_tokens: int | None = None, start: int = 0) -> tuple[torch.Tensor, object]:
        return self.pool.export_started(seq_id, num_tokens, start)

    def import_kv(self, seq_id: int, kv: torch.Tensor, protect=frozenset(), start: int = 0) -> bool:
        return self.pool.load(seq_id, kv, protect, start)

    def forward(self, batch: StepBatch, feed=None) -> torch.Tensor:
        """logits [B, V] float32 of each row's last token."""
        if feed is not None:
            raise ValueError("the transformers runner takes its input ids on the host")
        logits = None
        for group in self.groups(batch):
            out = self._forward(batch, group)
            if logits is None:
                logits = out.new_empty((batch.num_rows, out.shape[-1]))
            logits[torch.as_tensor(group, device=self.device)] = out
        return logits

    def forward_all(self, batch: StepBatch) -> torch.Tensor:
        """logits [T, V] float32 of every token of a batch of one row (prompt logprobs)."""
        if batch.num_rows != 1:
            raise ValueError("forward_all takes one row")
        return self._forward(batch, [0], every_token=True)

    def groups(self, batch: StepBatch) -> list[list[int]]:
        lens = np.diff(batch.query_start)
        decode = [i for i in range(batch.num_rows) if lens[i] == 1]
        prefill = sorted((i for i in range(batch.num_rows) if lens[i] > 1), key=lambda i: -lens[i])
        groups = [decode] if decode else []
        group, real = [], 0
        for i in prefill:
            n = int(lens[i])
            width = int(lens[group[0]]) if group else n
            if group and (len(group) + 1) * width > (1 + self.max_padding) * (real + n):
                groups.append(group)
                group, real = [], 0
            group.append(i)
            real += n
        if group:
            groups.append(group)
        return groups

    def _forward(self, batch: StepBatch, group: list[int], every_token: bool = False) -> torch.Tensor:
        qs = batch.query_start
        lens = np.array([qs[i + 1] - qs[i] for i in group])
        seq_lens = batch.seq_lens[group].astype(np.int64)
        starts = seq_lens - lens
        g, width, total = len(group), int(lens.max()), int(seq_lens.max())
        cols = np.arange(width)
        is_real = cols[None, :] < lens[:, None]
        token_index = np.where(is_real, qs[group][:, None] + cols[None, :], 0)
        ids = np.where(is_real, batch.ids[token_index], 0)
        positions = np.where(is_real, starts[:, None] + cols[None, :], starts[:, None])
        rr, cc = np.nonzero(is_real)
        slots = batch.slot_mapping[token_index[rr, cc]]
        dev = self.device
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev, non_blocking=True)
        pos_t = t(positions)
        keys = torch.arange(total, device=dev)
        # [g, 1, new, total]: a query sees keys at or before its own position; a pad query
        # sees key 0 only, so no row of the softmax is empty.
        mask = keys[None, None, :] <= pos_t[:, :, None]
        mask &= t(is_real)[:, :, None]
        mask[:, :, 0] = True
        table = t(batch.block_table[group, :self.pool.blocks_for(total)].astype(np.int64))
        view = PagedView(self.pool, table, t(rr), t(cc), t(slots), total, is_decode=width == 1)
        out = self.base(input_ids=t(ids), attention_mask=mask[:, None], position_ids=pos_t,
                        use_cache=True, **{self.cache_arg: view})
        if every_token:
            last = out.last_hidden_state[t(rr), t(cc)]
        else:
            last = out.last_hidden_state[torch.arange(g, device=dev), t(lens - 1)]
        logits = self.lm_head(last).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def cache_argument(base) -> str:
    """The name the model's forward takes its cache by: `cache` in newer transformers, which
    warn on every call that passes `past_key_values`; `past_key_values` before."""
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"

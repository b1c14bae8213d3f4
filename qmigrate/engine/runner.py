"""One sampling step for a batch of sequences of any lengths, on one device.

Rows new to this engine prefill their ids; rows it has cached decode from their last
token. Decode rows run together in one forward; prefill rows are grouped by length so
padding stays small. The model is any transformers causal LM whose attention layers call
`past_key_values.update(...)` and accept a prepared 4D mask (Llama, Mistral, Qwen2, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import install as install_attention
from .kvcache import BatchView, SlotPool
from .sampling import SamplingRows, sample


@dataclass(slots=True)
class StepRow:
    seq_id: int
    new_ids: list[int]      # this step's input: the whole sequence when start == 0
    start: int              # position of new_ids[0]; the engine holds KV for [0, start)
    index: int              # generated-token index of the token this step samples
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


class Engine:
    def __init__(self, model, *, num_slots: int, max_len: int | None = None,
                 max_padding: float = 0.25, grouped_attention: bool = True):
        self.model = model
        self.grouped_attention = grouped_attention and install_attention(model)
        self.base = getattr(model, model.base_model_prefix)
        self.lm_head = model.get_output_embeddings()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.max_context = int(getattr(cfg, "max_position_embeddings", 2048))
        self.max_len = min(max_len or self.max_context, self.max_context)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_params = sum(p.numel() for p in model.parameters())
        self.max_padding = max_padding
        self.pool = SlotPool(self.num_layers, self.num_kv_heads, self.head_dim, num_slots,
                             self.max_len, self.dtype, self.device)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.pool.keys[0].element_size()

    def cached_len(self, seq_id: int) -> int:
        return self.pool.cached_len(seq_id)

    def release(self, seq_id: int) -> None:
        self.pool.release(seq_id)

    def export_kv(self, seq_id: int) -> torch.Tensor:
        return self.pool.export(seq_id)

    def import_kv(self, seq_id: int, kv: torch.Tensor, protect: set[int] = frozenset()) -> None:
        self.pool.load(seq_id, kv, protect)

    @torch.inference_mode()
    def step(self, rows: list[StepRow]) -> list[int]:
        """Run one step for every row and return the sampled token of each, in row order."""
        protect = {r.seq_id for r in rows}
        for r in rows:
            if r.start == 0:
                self.pool.allocate(r.seq_id, protect)
            elif self.pool.cached_len(r.seq_id) < r.start:
                raise ValueError(f"sequence {r.seq_id}: KV for {r.start} positions is not here")
            else:
                self.pool.truncate(r.seq_id, r.start)
            if r.start + len(r.new_ids) > self.max_len:
                raise ValueError(f"sequence {r.seq_id}: {r.start + len(r.new_ids)} positions exceed {self.max_len}")
            self.pool.touch(r.seq_id)
        logits = torch.empty(len(rows), self.vocab_size, dtype=torch.float32, device=self.device)
        for group in self._groups(rows):
            logits[torch.tensor(group, device=self.device)] = self._forward([rows[i] for i in group])
        params = SamplingRows.build([r.temperature for r in rows], [r.top_p for r in rows],
                                    [r.top_k for r in rows], [r.seed for r in rows],
                                    [r.index for r in rows], self.device)
        tokens = sample(logits, params).tolist()
        for r in rows:
            self.pool.length[r.seq_id] = r.start + len(r.new_ids)
        return tokens

    def _groups(self, rows: list[StepRow]) -> list[list[int]]:
        decode = [i for i, r in enumerate(rows) if len(r.new_ids) == 1]
        prefill = sorted((i for i, r in enumerate(rows) if len(r.new_ids) > 1),
                         key=lambda i: -len(rows[i].new_ids))
        groups = [decode] if decode else []
        group, real = [], 0
        for i in prefill:
            n = len(rows[i].new_ids)
            width = len(rows[group[0]].new_ids) if group else n
            if group and (len(group) + 1) * width > (1 + self.max_padding) * (real + n):
                groups.append(group)
                group, real = [], 0
            group.append(i)
            real += n
        if group:
            groups.append(group)
        return groups

    def _forward(self, rows: list[StepRow]) -> torch.Tensor:
        lens = np.array([len(r.new_ids) for r in rows])
        starts = np.array([r.start for r in rows])
        batch, width = len(rows), int(lens.max())
        total = int((starts + lens).max())
        ids = np.zeros((batch, width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : lens[i]] = r.new_ids
        cols = np.arange(width)
        is_real = cols[None, :] < lens[:, None]
        positions = np.where(is_real, starts[:, None] + cols[None, :], starts[:, None])
        rr, cc = np.nonzero(is_real)
        dev = self.device
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev, non_blocking=True)
        pos_t = t(positions)
        keys = torch.arange(total, device=dev)
        # [B, 1, new, total]: a query sees keys at or before its own position; a pad query
        # sees key 0 only, so no row of the softmax is empty.
        mask = keys[None, None, :] <= pos_t[:, :, None]
        mask &= t(is_real)[:, :, None]
        mask[:, :, 0] = True
        slots = t(np.array([self.pool.slot_of[r.seq_id] for r in rows]))
        view = BatchView(self.pool, slots, t(rr), t(cc), slots[t(rr)], t(starts[rr] + cc), total,
                         is_decode=width == 1)
        out = self.base(input_ids=t(ids), attention_mask=mask[:, None], position_ids=pos_t,
                        past_key_values=view, use_cache=True)
        last = out.last_hidden_state[torch.arange(batch, device=dev), t(lens - 1)]
        return self.lm_head(last).float()

"""Log probabilities of sampled tokens and of prompts, computed where the logits are.

A generated token's logprob is the log-softmax of the logits it was sampled from: after the
sampling controls (min_tokens' masking, logit_bias, the penalties: engine/controls.py) and
after temperature (none for a greedy row), before min_p, top-k and top-p narrow the draw (as
vLLM's "processed" logprobs, without the truncation, so every value is finite). A prompt
token's is the log-softmax of the model's raw logits at the position before it.

Only rows that ask pay, and only on the device: one log-softmax over their rows, one gather
of the sampled token and one batched top-k; what reaches the host is the token's logprob
and the k alternatives per row, never the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class StepLogprobs:
    """The logprobs of one step's asking rows: `rows` (their rows of the step's logits),
    values [A, 1 + K] (the sampled token's, then the top K) and top ids [A, K]; on the device
    until `host` (pinned copies) holds them."""

    rows: np.ndarray
    values: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self, pin: bool) -> "StepLogprobs":
        if not pin:
            return self
        values = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
        top_ids = torch.empty(self.top_ids.shape, dtype=self.top_ids.dtype, pin_memory=True)
        values.copy_(self.values, non_blocking=True)
        top_ids.copy_(self.top_ids, non_blocking=True)
        return StepLogprobs(self.rows, values, top_ids)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, top ids) as numpy arrays, once the step is collected."""
        return self.values.numpy(), self.top_ids.numpy()


def asking_rows(asks: np.ndarray | None) -> tuple[np.ndarray, int] | None:
    """(rows that ask, the widest top-k asked) of a step's per-row requests (-1: none)."""
    if asks is None:
        return None
    rows = np.flatnonzero(asks >= 0)
    if not rows.size:
        return None
    return rows, int(asks[rows].max())


def sampled_logprobs(logits: torch.Tensor, temperature: torch.Tensor | None, tokens: torch.Tensor,
                     rows: np.ndarray, width: int) -> StepLogprobs:
    """logits [B, V] after the controls, temperature [B] (None or 0: greedy), tokens [B]
    sampled; the logprobs of `rows`, with `width` alternatives each."""
    if len(rows) == logits.shape[0]:   # every row asks (rows are in order): no gathering
        x, t, chosen_ids = logits.float(), temperature, tokens
    else:
        index = torch.as_tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        x, chosen_ids = logits.index_select(0, index).float(), tokens.index_select(0, index)
        t = temperature.index_select(0, index) if temperature is not None else None
    if t is not None:
        x = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    lp = x.log_softmax(dim=-1)
    chosen = lp.gather(1, chosen_ids[:, None].long())
    top = lp.topk(width, dim=-1)
    return StepLogprobs(rows, torch.cat([chosen, top.values], dim=1), top.indices.to(torch.int32))


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] raw at N consecutive positions, targets [N] the token after each:
    values [N, 2 + width] (each target's logprob, its rank (1: the likeliest), the top
    `width` logprobs) and top ids [N, width]."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, targets[:, None].long())
    rank = (lp > chosen).sum(dim=-1, keepdim=True).float() + 1
    top = lp.topk(width, dim=-1)
    return torch.cat([chosen, rank, top.values], dim=1), top.indices.to(torch.int32)


def taken(pending) -> tuple[dict, dict]:
    """Of a collected step: seq_id -> (values, top ids, row) of each asking row's sampled
    token (a reference into the step's arrays: wire/packed.py), and seq_id -> (values, top
    ids) of each prompt whose logprobs it computed (numpy arrays: `prompt_logprobs`)."""
    tokens = {}
    if pending.logprobs is not None:
        values, ids = pending.logprobs.arrays()
        placed, rows = pending.placed, pending.rows
        tokens = {rows[placed[r]].seq_id: (values, ids, k) for k, r in enumerate(pending.logprobs.rows.tolist())}
    prompts = {sid: (v.numpy(), t.numpy()) for sid, (v, t) in pending.prompt_logprobs.items()}
    return tokens, prompts

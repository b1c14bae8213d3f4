"""Sampling controls past temperature, top-p and top-k: presence, frequency and repetition
penalties, logit bias, min_p, and min_tokens' masking of the stop tokens.

Definitions, applied in this order to a row's float32 logits x (what the reference tests
compare against):
  min_tokens     while fewer than min_tokens tokens are generated, x[t] = -inf for every
                 EOS and stop token id t (transformers' MinNewTokensLengthLogitsProcessor);
  logit_bias     x[t] += bias[t] (OpenAI's);
  repetition     for every token t of the prompt or generated so far, x[t] * r if x[t] < 0,
                 else x[t] / r (transformers' RepetitionPenaltyLogitsProcessor);
  frequency, presence
                 x[t] -= c[t] * frequency + (c[t] > 0) * presence, c[t] the number of times t
                 was generated so far (OpenAI's definition);
and, after temperature, min_p drops every token whose probability is below min_p times the
largest (transformers' MinPLogitsWarper), before top-k and top-p.

The counts are rebuilt from the sequence's ids, never kept from one worker's past: a
sequence's ids by position live in row `slot` of one device slab, written from the full
form when a worker takes the sequence (the ids that travel with it) and by every sample
on the device (so a chained step, whose fed token never visits the host, counts it). A
step counts positions [0, prompt_len + index): what the router says the sequence holds.
So a sequence's next token is the same on any worker, after a migration, and after a
worker ran steps the router dropped.

Only what has controls pays: `step` is not called while no sequence here has any, and
builds work for the controlled rows of a step only, in a few array operations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from qmigrate.wire import protocol as P


@dataclass(frozen=True, slots=True)
class Controls:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()     # masked while fewer than min_tokens are generated
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()

    @classmethod
    def of_spec(cls, spec: P.SeqSpec) -> "Controls":
        return cls(spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty, spec.min_p,
                   spec.min_new_tokens if spec.eos_ids else 0, tuple(spec.eos_ids),
                   tuple(spec.bias_ids), tuple(spec.bias_values))

    @property
    def is_active(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_p or self.min_tokens or self.bias_ids)


@dataclass(slots=True)
class StepControls:
    """The controlled rows of one step, as tensors on the logits' device."""

    rows: torch.Tensor         # int64 [C]: their rows in the step's logits
    slots: torch.Tensor        # int64 [C]: their rows in the slab
    ends: torch.Tensor         # int64 [C]: positions counted, prompt_len + index
    prompt_lens: torch.Tensor  # int64 [C]
    presence: torch.Tensor     # float32 [C]
    frequency: torch.Tensor
    repetition: torch.Tensor
    min_p: torch.Tensor | None           # float32 [C]; None: no row has min_p
    early_stops: torch.Tensor | None     # int64 [C, S]: stop ids masked now (-1: none)
    bias: tuple[torch.Tensor, torch.Tensor] | None   # int64 [C, K] ids, float32 [C, K] values
    is_penalized: bool
    width: int                 # positions gathered from the slab: max(ends)

    def apply(self, logits: torch.Tensor, slab: torch.Tensor) -> torch.Tensor:
        """The step's logits with the controlled rows changed (a new tensor)."""
        x = logits[self.rows].float()
        if self.early_stops is not None:
            stops = self.early_stops   # padding (-1) adds 0 to token 0
            x.scatter_add_(1, stops.clamp(min=0), torch.where(stops >= 0, float("-inf"), 0.0))
        if self.bias is not None:
            x.scatter_add_(1, *self.bias)
        if self.is_penalized:
            ids = slab[self.slots, :self.width].long()                       # [C, W]
            pos = torch.arange(self.width, device=ids.device)[None, :]
            seen_mask = (pos < self.ends[:, None]).float()
            out_mask = seen_mask * (pos >= self.prompt_lens[:, None]).float()
            seen = torch.zeros_like(x).scatter_add_(1, ids, seen_mask) > 0
            counts = torch.zeros_like(x).scatter_add_(1, ids, out_mask)
            r = self.repetition[:, None]
            x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
            x = x - counts * self.frequency[:, None] - (counts > 0).float() * self.presence[:, None]
        out = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
        out[self.rows] = x
        return out

    def filter_min_p(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, V] after temperature: tokens below min_p of the row's most likely dropped."""
        if self.min_p is None:
            return x
        y = x[self.rows]
        probs = y.softmax(dim=-1)
        drop = probs < self.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        x = x.clone()
        x[self.rows] = y.masked_fill(drop, float("-inf"))
        return x


class ControlTable:
    """The controls of the sequences a worker holds, and their ids by position."""

    def __init__(self, vocab_size: int, max_len: int, device) -> None:
        self.vocab_size, self.max_len, self.device = vocab_size, max_len, device
        self.slot_of: dict[int, int] = {}
        self.controls: list[Controls | None] = []
        self.prompt_len = np.zeros(0, dtype=np.int64)
        self.free: list[int] = []
        self.slab = torch.zeros(0, max_len, dtype=torch.int32, device=device)

    def __bool__(self) -> bool:
        return bool(self.slot_of)

    def set(self, seq_id: int, controls: Controls, ids: np.ndarray, prompt_len: int) -> None:
        """Take a sequence's controls and its ids so far (prompt, then generated)."""
        if controls.bias_ids or controls.stop_token_ids:   # an id past the logits is never sampled
            vocab = self.vocab_size
            bias = [(t, v) for t, v in zip(controls.bias_ids, controls.bias_values) if t < vocab]
            controls = dataclasses.replace(controls, bias_ids=tuple(t for t, _ in bias),
                                           bias_values=tuple(v for _, v in bias),
                                           stop_token_ids=tuple(t for t in controls.stop_token_ids if t < vocab))
        if not controls.is_active:
            self.forget(seq_id)
            return
        slot = self.slot_of.get(seq_id)
        if slot is None:
            if not self.free:
                self._grow()
            slot = self.slot_of[seq_id] = self.free.pop()
        self.controls[slot] = controls
        self.prompt_len[slot] = prompt_len
        n = min(len(ids), self.max_len)
        self.slab[slot, :n] = torch.tensor(np.asarray(ids[:n]), dtype=torch.int32).to(self.device)

    def forget(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.controls[slot] = None
            self.free.append(slot)

    def _grow(self) -> None:
        old = len(self.controls)
        new = max(8, 2 * old)
        slab = torch.zeros(new, self.max_len, dtype=torch.int32, device=self.device)
        slab[:old] = self.slab
        self.slab = slab
        self.controls.extend([None] * (new - old))
        self.prompt_len = np.concatenate([self.prompt_len, np.zeros(new - old, dtype=np.int64)])
        self.free.extend(range(new - 1, old - 1, -1))

    def step(self, seq_ids, index: np.ndarray) -> StepControls | None:
        """The controls of a step's rows (seq_ids[k] samples generated token index[k]); None
        when no row has any."""
        slot_of = self.slot_of
        rows = [k for k, s in enumerate(seq_ids) if s in slot_of]
        if not rows:
            return None
        slots = np.fromiter((slot_of[seq_ids[k]] for k in rows), dtype=np.int64, count=len(rows))
        ctl = [self.controls[s] for s in slots]
        idx = np.asarray(index, dtype=np.int64)[rows]
        prompt_lens = self.prompt_len[slots]
        ends = np.minimum(prompt_lens + idx, self.max_len)
        presence = np.array([c.presence_penalty for c in ctl], dtype=np.float32)
        frequency = np.array([c.frequency_penalty for c in ctl], dtype=np.float32)
        repetition = np.array([c.repetition_penalty for c in ctl], dtype=np.float32)
        min_p = np.array([c.min_p for c in ctl], dtype=np.float32)
        early = [c.stop_token_ids if i < c.min_tokens else () for c, i in zip(ctl, idx.tolist())]
        dev = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)
        stops = None
        if any(early):
            width = max(map(len, early))
            stops = dev(np.array([list(e) + [-1] * (width - len(e)) for e in early], dtype=np.int64))
        bias = None
        if any(c.bias_ids for c in ctl):
            width = max(len(c.bias_ids) for c in ctl)
            # padding adds 0 to token 0
            ids = np.array([list(c.bias_ids) + [0] * (width - len(c.bias_ids)) for c in ctl], dtype=np.int64)
            values = np.array([list(c.bias_values) + [0.0] * (width - len(c.bias_values)) for c in ctl],
                              dtype=np.float32)
            bias = dev(ids), dev(values)
        is_penalized = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
        return StepControls(dev(np.asarray(rows, dtype=np.int64)), dev(slots), dev(ends), dev(prompt_lens),
                            dev(presence), dev(frequency), dev(repetition),
                            dev(min_p) if (min_p > 0).any() else None, stops, bias, is_penalized,
                            int(ends.max()) if is_penalized else 0)

    def record(self, step: StepControls, tokens: torch.Tensor) -> None:
        """Write the tokens a step sampled for its controlled rows into the slab, on the device."""
        pos = step.ends.clamp(max=self.max_len - 1)
        self.slab[step.slots, pos] = tokens[step.rows].to(torch.int32)

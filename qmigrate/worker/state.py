"""A worker's bookkeeping, as plain data: what it keeps per sequence (and when a sequence
ends: the stop rule the offline loop shares), a lease under way, and KV shipped to it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from qmigrate.engine.rows import StepRow
from qmigrate.wire import protocol as P
from qmigrate.wire.protocol import Finish


@dataclass(slots=True)
class SeqState:
    prompt_len: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_ids: list[list[int]]
    eos_ids: frozenset[int]
    tail: list[int] = field(default_factory=list)   # recent tokens, for stop sequences
    last_token: int = -1                            # sampled here, not yet in the KV
    min_new_tokens: int = 0
    num_logprobs: int = -1
    num_prompt_logprobs: int = -1

    @classmethod
    def from_spec(cls, spec: P.SeqSpec, ids: np.ndarray) -> "SeqState":
        keep = max((len(s) for s in spec.stop_ids), default=0)
        seed = spec.seed if spec.seed >= 0 else spec.seq_id
        tail = ids[spec.prompt_len:].tolist()[-keep:] if keep else []
        return cls(spec.prompt_len, spec.max_new_tokens, spec.temperature, spec.top_p, spec.top_k,
                   seed, spec.stop_ids, frozenset(spec.eos_ids), tail, min_new_tokens=spec.min_new_tokens,
                   num_logprobs=spec.num_logprobs, num_prompt_logprobs=spec.num_prompt_logprobs)

    def finish_after(self, token: int, index: int, length: int, max_len: int) -> Finish:
        """Status once `token`, generated token number `index`, joined a sequence of `length`."""
        early = index + 1 < self.min_new_tokens
        if token in self.eos_ids and not early:
            return Finish.EOS
        if self.stop_ids:
            self.tail.append(token)
            keep = max(len(s) for s in self.stop_ids)
            del self.tail[:-keep]
            if not early and any(self.tail[-len(s):] == s for s in self.stop_ids if s):
                return Finish.STOP
        if index + 1 >= self.max_new_tokens or length >= max_len:
            return Finish.LENGTH
        return Finish.NONE


@dataclass(slots=True)
class Started:
    """A lease whose first step is on the device."""

    lease: P.Lease
    seq_ids: list[int]
    status: dict[int, Finish]
    out: dict[int, list[int]]
    rows: list[StepRow] = field(default_factory=list)
    first_index: dict[int, int] = field(default_factory=dict)
    resend: dict[int, list[int]] = field(default_factory=dict)
    pending: object = None
    shown: dict[int, int] = field(default_factory=dict)   # tokens already sent to the detokenizer
    announced: set[int] = field(default_factory=set)      # rows whose end it has been sent
    ended: set[int] = field(default_factory=set)          # rows whose status is a finish (cheap to test)
    lost: list[int] = field(default_factory=list)         # rows cut short with their KV dropped
    cached: dict[int, int] = field(default_factory=dict)  # rows started here: positions found cached
    lps: dict[int, list] = field(default_factory=dict)    # rows asking: each token's logprobs, as out
    prompt_lps: dict[int, tuple] = field(default_factory=dict)   # rows whose prompt's logprobs are made


@dataclass(slots=True)
class Transfer:
    seq_id: int
    kv: torch.Tensor | None   # None: the owner had nothing to send
    arrived: float
    start: int = 0            # kv holds positions [start, start + n)

"""A step's rows: what the engine is asked to run (`StepRow`), what a launched step holds
(`Pending`), and how a step's prompt rows share its token budget."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from qmigrate.engine.batch import StepBatch
from qmigrate.engine.sampling import HostRows

if TYPE_CHECKING:
    from qmigrate.engine.config import EngineConfig

REFUSED = -1   # the token of a row the pool had no room for


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
    cache_salt: str = ""    # prefixes are shared only among rows of the same salt
    num_logprobs: int = -1          # >= 0: the sampled token's logprob and this many alternatives
    num_prompt_logprobs: int = -1   # >= 0 (a prompt's first step): every prompt token's too


@dataclass(slots=True)
class Pending:
    """A launched step: its rows, which of them run, and where their tokens land."""

    rows: list[StepRow]
    placed: list[int]
    row_of: dict[int, int]                  # seq_id -> row of `tokens`
    tokens: torch.Tensor | None = None      # [len(placed)] on the device
    batch: StepBatch | None = None          # the placed rows' arrays, for the step after
    params: HostRows | None = None          # their sampling parameters, likewise
    host: torch.Tensor | None = None        # pinned copy, ready once `event` has passed
    event: object = None
    result: list[int] | None = None
    cached: dict[int, int] = dataclasses.field(default_factory=dict)   # seq_id -> prompt positions found cached
    partial: set[int] = dataclasses.field(default_factory=set)   # sequences whose prompt goes on in a later step
    asks: np.ndarray | None = None          # int32 per placed row: its num_logprobs (None: no row asks)
    logprobs: object = None                 # logprobs.StepLogprobs of the asking rows
    prompt_logprobs: dict = dataclasses.field(default_factory=dict)   # seq_id -> (values, top ids)
    # a step whose constrained rows sample after a token of the step before, still on the
    # device: its logits wait for the masks that collecting `waits_on` fills (engine/step_sampling.py)
    logits: torch.Tensor | None = None
    waits_on: "Pending | None" = None
    masking: object = None                  # its masks being filled (GrammarTable.start: a grammar.Job)
    then: "Pending | None" = None           # the step launched after this one that waits on it


def prompt_budget(rows: list[StepRow], cfg: EngineConfig) -> int:
    """Prompt tokens this step may carry (0: no limit). Every decode row's stream waits for
    the whole step, so while there are some, prompts get `prefill_tokens_with_decode`, or
    1/`prefill_spread_steps` of the prompt tokens waiting in the step if that is more: a
    backlog is never spread over more than that many steps (a fixed limit makes a burst's
    backlog grow, and with it every later prompt's wait), while prompts arriving one by one
    are evened out over the steps. A step of prompts alone gets `max_num_batched_tokens`, since
    prompts held back by that limit (which the router leased as one-token rows) join its
    lease's own prompts."""
    budget, capped = cfg.prefill_tokens_per_step, cfg.prefill_tokens_with_decode
    if capped <= 0:
        return budget
    if not any(r.start > 0 and len(r.new_ids) <= 1 for r in rows):
        capped = cfg.max_num_batched_tokens
    elif cfg.prefill_spread_steps > 0:
        waiting = sum(len(r.new_ids) for r in rows if len(r.new_ids) > 1)
        capped = max(capped, -(-waiting // cfg.prefill_spread_steps))
    return min(budget, capped) if budget > 0 else capped


def share_prompt_budget(rows: list[StepRow], budget: int) -> tuple[list[StepRow], set[int], set[int]]:
    """Rows whose new ids are a prompt (more than one) take `budget` tokens in row order (0:
    no limit): (rows, indices of rows cut to their first part, indices of rows left out)."""
    cut, deferred = set(), set()
    if budget <= 0 or sum(len(r.new_ids) for r in rows if len(r.new_ids) > 1) <= budget:
        return rows, cut, deferred
    rows = list(rows)
    for i, r in enumerate(rows):
        n = len(r.new_ids)
        if n <= 1:
            continue
        if budget <= 0:
            deferred.add(i)
        elif n > budget:
            rows[i] = dataclasses.replace(r, new_ids=r.new_ids[:budget])
            cut.add(i)
        budget -= n
    return rows, cut, deferred


def num_new(r: StepRow) -> int:
    return max(1, len(r.new_ids))  # no new_ids: the one token its previous step samples

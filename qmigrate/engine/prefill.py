"""The parts of a step that run before its forward pass proper: prompts started on their
cached prefix, a prompt's logprobs (all of the prompt but its last token, a chunk at a time)
and the leading chunks of long prompts. All are `Engine.launch`'s, given the engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from qmigrate.engine import logprobs as lp
from qmigrate.engine.batch import StepBatch
from qmigrate.engine.rows import StepRow


def admit_prompts(engine, rows: list[StepRow]) -> tuple[list[StepRow], dict[int, int]]:
    """Prompts (rows from position 0) start on their longest cached prefix; the rows to
    run, and the positions each prompt found cached."""
    if not engine.pool.is_caching:   # nothing to look in: what a prompt finds is unknown (no entry), not 0
        return rows, {}
    cached, out = {}, list(rows)
    for i, r in enumerate(rows):
        if r.start == 0 and r.new_ids:
            # a prompt whose logprobs are asked for computes every position
            n = cached[r.seq_id] = engine.pool.admit(r.seq_id, r.new_ids, r.cache_salt,
                                                     reuse=not wants_prompt_logprobs(engine, r))
            if n:
                out[i] = dataclasses.replace(r, new_ids=r.new_ids[n:], start=n)
    return out, cached


def wants_prompt_logprobs(engine, r: StepRow) -> bool:
    """Whether a row computes its prompt's logprobs (at the step of its first token)."""
    return (r.num_prompt_logprobs >= 0 and r.index == 0 and r.start == 0 and len(r.new_ids) > 1
            and hasattr(engine.runner, "forward_all"))


def prompt_pass(engine, rows: list[StepRow], between) -> tuple[list[StepRow], set[int], dict]:
    """Rows that ask for their prompt's logprobs (at the step of their first token) run
    all of the prompt but its last token here, a chunk at a time, keeping the logprobs of
    each next prompt token; the step proper runs the last one. Returns the rows left for
    the step, the indices of rows the pool had no room for, and seq_id -> (values [P - 1,
    2 + k], top ids [P - 1, k]) (engine/logprobs.py)."""
    out: dict = {}
    if not any(wants_prompt_logprobs(engine, r) for r in rows):
        return rows, set(), out
    chunk = min(engine.config.prefill_chunk or 512, 512)   # bounds the [chunk, V] logits
    rows, refused, protect = list(rows), set(), {r.seq_id for r in rows}
    for i, r in enumerate(rows):
        if not wants_prompt_logprobs(engine, r):
            continue
        ids, n = r.new_ids, len(r.new_ids) - 1
        targets = torch.as_tensor(ids[1:], dtype=torch.int64).to(engine.device)
        parts = []
        for start in range(0, n, chunk):
            piece = StepRow(r.seq_id, ids[start:min(n, start + chunk)], start, r.index)
            if engine.place([piece], protect) != [0]:
                refused.add(i)
                break
            logits = engine.runner.forward_all(StepBatch.build(engine.pool, [r.seq_id], [piece.new_ids], [start]))
            parts.append(lp.prompt_logprobs(logits, targets[start:start + len(piece.new_ids)],
                                            r.num_prompt_logprobs))
            engine.pool.mark_written([r.seq_id], [start + len(piece.new_ids)], [piece])
            if between is not None:
                between()
        if i in refused:
            continue
        values, top_ids = (torch.cat([p[k] for p in parts]) for k in (0, 1))
        whole = lp.StepLogprobs(np.zeros(0, dtype=np.int64), values, top_ids).to_host(engine.device.type == "cuda")
        out[r.seq_id] = (whole.values, whole.top_ids)
        rows[i] = dataclasses.replace(r, new_ids=ids[n:], start=n)
    return rows, refused, out


def prefill_chunks(engine, rows: list[StepRow], between, skip=frozenset()) -> tuple[list[StepRow], set[int]]:
    """Fill all but the last chunk of long prompts (but rows in `skip`); the rows left for
    the step proper, and the indices of rows the pool had no room for."""
    chunk = engine.config.prefill_chunk
    if not chunk or all(len(r.new_ids) <= chunk for r in rows):
        return rows, set()
    rows, refused, protect = list(rows), set(), {r.seq_id for r in rows}
    for i, r in enumerate(rows):
        if i in skip:
            continue
        start, new = r.start, r.new_ids
        while len(new) > chunk:
            piece = StepRow(r.seq_id, new[:chunk], start, r.index)
            if engine.place([piece], protect) != [0]:
                refused.add(i)
                break
            engine.runner.forward(StepBatch.build(engine.pool, [r.seq_id], [piece.new_ids], [start]))
            engine.pool.mark_written([r.seq_id], [start + chunk], [piece])
            start, new = start + chunk, new[chunk:]
            if between is not None:
                between()
        rows[i] = dataclasses.replace(r, new_ids=new, start=start)
    return rows, refused

"""A launched step's sampling, queued on the device behind its forward pass: at once (`queue`),
or, for a step whose constrained rows sample after a token of the step before it still on the
device, once their grammar masks are filled. Collecting that step before (`note_collected`)
starts the masks where the matchers are (`GrammarTable.start`: a thread, or their own
process); the worker asks as it does its own work whether they are filled (`settle` without
waiting); at the latest the next step's forward pass, or the step's collect, waits for them
(`settle`). Functions of the engine, as prefill.py's are."""

from __future__ import annotations

import time

import torch

from qmigrate.engine import logprobs as lp
from qmigrate.engine.grammar import apply_masks
from qmigrate.engine.sampling import SamplingRows, sample


def queue(engine, pending, logits: torch.Tensor, masks) -> None:
    """Queue the sampling of a step whose forward pass is queued (and its logprobs, and the
    copy of its tokens to the host)."""
    batch, params = pending.batch, pending.params
    if masks is not None:
        logits = apply_masks(logits, *masks)
    controls = engine.controls.step(batch.seq_ids, params[4]) if engine.controls else None
    sampling = SamplingRows.from_arrays(params, engine.device)
    asking = lp.asking_rows(pending.asks)
    processed = [] if asking is not None else None
    if controls is None:
        pending.tokens = sample(logits, sampling, logits_out=processed)
    else:
        pending.tokens = sample(logits, sampling, controls, engine.controls.slab, logits_out=processed)
        engine.controls.record(controls, pending.tokens)
    if asking is not None:   # one log-softmax, gather and top-k over the asking rows only
        pending.logprobs = lp.sampled_logprobs(processed[0], sampling.temperature, pending.tokens,
                                               *asking).to_host(engine.device.type == "cuda")
    if engine.device.type == "cuda":
        pending.host = torch.empty(batch.num_rows, dtype=torch.int64, pin_memory=True)
        pending.host.copy_(pending.tokens, non_blocking=True)
        pending.event = torch.cuda.Event()
        pending.event.record()


def settle(engine, pending, wait: bool = True) -> None:
    """Queue the sampling of a step that waits for its masks; nothing for any other step.
    `wait`: collect the step before it if that is still to do, and wait for the masks; else
    only if they are filled already."""
    if pending is None or pending.logits is None:
        return
    if not wait:
        if pending.masking is not None and engine.grammars.done(pending.masking):
            _sample_waiting(engine, pending, early=True)
        return
    if pending.masking is None:
        engine.collect(pending.waits_on)
        if pending.logits is None:   # queued by that collect (masks the device waits for)
            return
    _sample_waiting(engine, pending)


def note_collected(engine, pending, values: list[int]) -> None:
    """The matchers take a collected step's tokens. A step launched after it that waits for
    them (`Engine._run`: its forward pass is queued) has them taken and its masks filled where
    the matchers are, while the worker does its own work on the collected step and the device
    runs that forward pass."""
    then, pending.then = pending.then, None
    noted = (pending.batch.seq_ids, pending.params[4], values, pending.partial, pending.row_of)
    if then is not None and then.logits is not None:
        then.masking = engine.grammars.start(then.batch.seq_ids, then.params[4], noted, then.row_of)
        if then.masking.plan is not None:   # masks the device waits for: its sampling is queued now
            _sample_waiting(engine, then, early=True)
    elif engine.grammars:
        engine.grammars.note(*noted)


@torch.inference_mode()
def _sample_waiting(engine, pending, early: bool = False) -> None:
    job, pending.masking = pending.masking, None
    if job is not None:
        began = time.perf_counter()
        masks, took = engine.grammars.finish(job)
        engine.trace("masks", len(masks[0]) if masks else 0, took, time.perf_counter() - began, int(early))
    else:   # the step it waited on was collected before it waited: the matchers took its tokens then
        masks = engine.grammars.masks(pending.batch.seq_ids, pending.params[4], pending.row_of) \
            if engine.grammars else None
    logits, pending.logits, pending.waits_on = pending.logits, None, None
    queue(engine, pending, logits, masks)

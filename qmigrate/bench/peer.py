"""The installed peer on the same workload: transformers' own continuous batching (the engine
behind `model.generate_batch`, with its paged KV cache), driven through its manager so that
each request gets its own output length, as every other path does. Greedy, EOS ignored."""

from __future__ import annotations

import sys
import time

from qmigrate.bench.timeline import PathResult, Progress, free, sync

RESULT_WAIT_S = 1.0
STALL_S = 600.0   # no request finishing for this long: the peer's thread has died or hangs


def run_transformers_cb(model_path: str, device: str, dtype: str, requests, load_format: str = "auto",
                        max_tokens: int = 2048) -> PathResult:
    """(prompt ids, output length) per request, all submitted at time 0; TTFT is not seen
    (the manager hands a request over when it ends), TPOT neither. On the CPU the cache holds
    the whole workload and a step up to `max_tokens` tokens (the engine's budget) or the
    longest prompt: transformers sizes it from the host's free memory otherwise, and fills an
    attention mask of that many tokens squared as it starts (a minute of CPU time)."""
    from transformers import GenerationConfig
    from qmigrate.hub.loading import load_model
    model, _ = load_model(model_path, device, dtype, load_format=load_format)
    longest = max(n for _, n in requests)
    # no EOS: every request runs to its own max_new_tokens
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0,
                              use_cuda_graph=False)
    lengths = [n for _, n in requests]
    progress = Progress("transformers-cb", len(requests), len(requests))
    manager = model.init_continuous_batching(generation_config=config,
                                             **(_cpu_cache(requests, max_tokens) if device == "cpu" else {}))
    manager.start()
    try:
        _warm_up(manager, requests[0][0])
        sync(device)
        t0 = time.monotonic()
        for i, (ids, n) in enumerate(requests):
            manager.add_request(list(ids), request_id=f"r{i}", max_new_tokens=n)
        done, generated, last = {}, 0, time.monotonic()
        while len(done) < len(requests):
            result = manager.get_result(timeout=RESULT_WAIT_S)
            if result is None:
                if time.monotonic() - last > STALL_S:
                    raise RuntimeError(f"transformers' continuous batching finished {len(done)} of "
                                       f"{len(requests)} requests and then none for {STALL_S:.0f} s")
                continue
            if not result.request_id.startswith("r") or not result.is_finished():
                continue
            if getattr(result, "error", None):
                raise RuntimeError(f"transformers' continuous batching failed request {result.request_id}: "
                                   f"{result.error}")
            done[result.request_id] = time.monotonic()
            generated += len(result.generated_tokens)
            last = time.monotonic()
            progress.update(generated, len(done))
        seconds = time.monotonic() - t0
    finally:
        manager.stop(block=True)
        progress.close()
    if generated != sum(lengths):
        print(f"  transformers-cb: {generated:,} tokens generated of {sum(lengths):,} asked", file=sys.stderr)
    del model, manager
    free(device)
    return PathResult("transformers-cb", seconds, generated)


def _cpu_cache(requests, max_tokens: int) -> dict:
    """init_continuous_batching's cache settings for the workload ({}: transformers' own, where
    this release has no ContinuousBatchingConfig to give them in)."""
    import inspect
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.continuous_api import ContinuousMixin
    except ImportError:
        return {}
    if "continuous_batching_config" not in inspect.signature(ContinuousMixin.init_continuous_batching).parameters:
        return {}
    page = getattr(ContinuousBatchingConfig(), "page_size", None) or ContinuousBatchingConfig().block_size
    # every request's whole length at once; the warm-up (up to 20 tokens) runs alone before them
    blocks = max(sum(-(-(len(ids) + n + 1) // page) for ids, n in requests), -(-21 // page))
    longest = max(len(ids) for ids, _ in requests)
    return {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=blocks,
                                                                   max_batch_tokens=max(max_tokens, longest + 1))}


def _warm_up(manager, ids) -> None:
    """One short request before the clock starts: the first step of a new shape is slow."""
    manager.add_request(list(ids[:16]), request_id="warm-up", max_new_tokens=4)
    deadline = time.monotonic() + STALL_S
    while time.monotonic() < deadline:
        result = manager.get_result(timeout=RESULT_WAIT_S)
        if result is not None and result.request_id == "warm-up" and result.is_finished():
            return
    raise RuntimeError("transformers' continuous batching did not finish its warm-up request")

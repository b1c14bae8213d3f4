"""What an engine does once, before it serves: size its KV pool from the device's memory
(after measuring the largest step's activations on a scratch pool), give it its host tier, say
what it runs on, and warm its kernels up with throwaway steps, then time one step of prompts."""

from __future__ import annotations

import logging
import time

import torch

from qmigrate.engine.batch import StepBatch
from qmigrate.engine.kv.host_tier import HostTier, tier_bytes
from qmigrate.engine.kv.pool import BlockPool
from qmigrate.engine.rows import REFUSED, StepRow
from qmigrate.engine.sampling import SamplingRows, sample

log = logging.getLogger(__name__)


def release_checkpoint(runner, model) -> None:
    """Free the checkpoint's GPU tensors the fast runner's model does not hold (handed over
    by the engine's caller, before the pool is sized from the free memory)."""
    built = getattr(runner, "model", None)
    if built is None or built is model:
        return
    from qmigrate.engine.models.base import release_unheld
    released = release_unheld(model, built)
    torch.cuda.empty_cache()
    log.info("%.2f GiB of checkpoint tensors the runner does not hold released before sizing the KV pool",
             released / 2**30)


def attach_tier(engine) -> None:
    """The host tier of kv_offloading_size, where it applies: a pool that caches prefixes and
    copies its own blocks (not a tensor-parallel group's)."""
    on_gpu = engine.device.type == "cuda"
    size = tier_bytes(engine.config.kv_offloading_size, on_gpu, torch.cuda.device_count() if on_gpu else 1)
    if size and engine.pool.is_caching and engine.pool.can_copy:
        engine.pool.attach_tier(HostTier(engine.pool.kv, size))


def describe(engine) -> str:
    """One line of what the engine runs on: its runner, its KV pool and host tier."""
    p, tp = engine.pool, engine.tp
    ranks = "" if tp is None else f", tensor parallel over {tp.world} ranks (pool per rank)"
    tier = "" if p.tier is None else (f", host tier of {p.tier.capacity * p.tier.block_bytes / 2**30:.2f} GiB"
                                      + (" (allocated while idle)" if p.tier.grows_idle else ""))
    return (f"{engine.runner.name} runner ({engine.runner_reason}{ranks}), KV pool of {p.capacity_tokens:,} tokens "
            f"({p.num_blocks - 1:,} blocks of {p.block_size}, {str(p.dtype).removeprefix('torch.')}, "
            f"{p.kv.numel() * p.kv.element_size() / 2**30:.2f} GiB){tier}")


def num_blocks_here(engine) -> int:
    """KV blocks this process's pool can hold: from the device's memory after the weights and
    a measured step's activations (a GPU), or cpu_kvcache_space_bytes, capped by max_kv_tokens."""
    cfg = engine.config
    per_block = engine.kv_bytes_per_token * engine.pool_kv_heads // engine.shape.num_kv_heads * cfg.block_size
    if engine.device.type == "cuda":
        budget = gpu_kv_budget(engine.device, cfg.gpu_memory_utilization, activation_bytes(engine))
    else:
        budget = cfg.cpu_kvcache_space_bytes
    blocks = budget // per_block
    if cfg.max_kv_tokens:
        blocks = min(blocks, -(-cfg.max_kv_tokens // cfg.block_size))
    # one sequence at full length must fit, or the pool is useless
    need = -(-engine.max_len // cfg.block_size)
    if blocks < need:
        if engine.device.type == "cuda" and not cfg.max_kv_tokens:
            raise MemoryError(f"{budget / 2**30:.2f} GiB left for the KV pool on {engine.device}: not enough "
                              f"for one sequence of {engine.max_len} tokens (raise gpu_memory_utilization)")
        blocks = need
    return int(blocks) + 1  # block 0 is the zero block


def activation_bytes(engine) -> int:
    """Peak memory of the largest step, measured by running one on a scratch pool."""
    cfg = engine.config
    num_rows = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // 64))
    per_row = max(1, min(engine.max_len, cfg.max_num_batched_tokens // num_rows))
    blocks = num_rows * (-(-per_row // cfg.block_size)) + 1
    scratch = BlockPool(engine.shape.num_layers, engine.pool_kv_heads, engine.shape.head_dim, blocks, cfg.block_size,
                        engine.kv_dtype, engine.device, prefix_cache=False)
    engine.runner.attach(scratch, capture=False)
    seq_ids = list(range(num_rows))
    for sid in seq_ids:
        scratch.grow(sid, per_row)
    batch = StepBatch.build(scratch, seq_ids, [[1] * per_row] * num_rows, [0] * num_rows)
    torch.cuda.synchronize(engine.device)
    torch.cuda.reset_peak_memory_stats(engine.device)
    before = torch.cuda.memory_allocated(engine.device)
    with torch.inference_mode():
        logits = engine.runner.forward(batch)
        # one row's logits copied to max_num_seqs rows (the step above may have fewer rows)
        n = cfg.max_num_seqs
        sample(logits[:1].expand(n, -1).contiguous(),
               SamplingRows.build([1.0] * n, [0.9] * n, [50] * n, [0] * n, [0] * n, engine.device))
    torch.cuda.synchronize(engine.device)
    peak = torch.cuda.max_memory_allocated(engine.device) - before
    del scratch, batch, logits
    engine.runner.attach(None, capture=False)
    torch.cuda.empty_cache()
    # CUDA graphs (those of steps with prompts hold up to 4,096 tokens' activations) and
    # allocator slack
    return int(peak * 1.2) + (512 << 20)


def made_up_ids(n: int, vocab_size: int) -> list[int]:
    """n ids for a throwaway prompt, all inside the model's vocabulary (a model may have
    fewer than a few hundred tokens: an id past its embedding is a device-side assert on a
    GPU). Ids 10 on skip the special tokens that small vocabularies put first."""
    low = 10 if vocab_size > 20 else 0
    span = max(1, min(500, vocab_size - low))
    return [low + j % span for j in range(n)]


def warm_up(engine) -> None:
    """The throwaway steps of Engine.warm_up."""
    # Prompt lengths of several kinds (one token, odd, a multiple of 16, over a chunk):
    # compiled kernels are specialised on such properties of their sizes.
    lengths = [1, 17, 96, max(600, engine.config.prefill_chunk + 88)]
    lengths = [max(1, min(n, engine.max_len - 4)) for n in lengths]
    rows = [StepRow(-1 - i, made_up_ids(n, engine.shape.vocab_size), 0, 0) for i, n in enumerate(lengths)]
    for _ in range(3):
        tokens = engine.step(rows)
        if REFUSED in tokens:
            break
        rows = [StepRow(r.seq_id, [t], r.start + len(r.new_ids), r.index + 1) for r, t in zip(rows, tokens)]
    for r in rows:
        engine.release(r.seq_id)
    # A burst of prompts arrives as steps past the CUDA graphs, which the runner pads to a
    # few token counts: one step of each, so that no request waits on a matmul's first
    # run at a new shape (a first launch took several times as long as the later ones:
    # docs/benchmarks-history.md).
    for size in engine.runner.eager_sizes():
        if -(-size // _chunk(engine)) > engine.config.max_num_seqs:
            break  # no step of so many tokens fits in max_num_seqs rows of a chunk each
        if REFUSED in _burst_step(engine, size):
            break


def _chunk(engine) -> int:
    """Tokens a throwaway prompt row takes in one step: a chunk, as a long prompt does."""
    return max(2, min(engine.config.prefill_chunk or 512, engine.max_len - 4))


def _burst_step(engine, num_tokens: int) -> list[int]:
    """One step of throwaway prompts of num_tokens in all, a chunk a row, as a burst of prompts
    runs; their KV released after. The tokens it sampled (REFUSED where the pool had no room)."""
    n = _chunk(engine)
    lengths = [n] * (num_tokens // n) + ([num_tokens % n] if num_tokens % n else [])
    rows = [StepRow(-100 - i, made_up_ids(k, engine.shape.vocab_size), 0, 0) for i, k in enumerate(lengths)]
    tokens = engine.step(rows)   # waits for the step: its tokens are on the host
    for r in rows:
        engine.release(r.seq_id)
    return tokens


def prefill_rate(engine, repeats: int = 3) -> int:
    """Prompt tokens a second of one step of prompts alone, the fastest of `repeats` (0 when the
    pool has no room for it): a step of up to 4,096 tokens in chunks of `prefill_chunk`, as a
    burst of prompts runs. The router weighs shipping a sequence's KV against prefilling it
    again by this rate rather than by the `prefill_tflops` setting."""
    cfg = engine.config
    total = max(_chunk(engine), min(cfg.max_num_batched_tokens, 4096, _chunk(engine) * cfg.max_num_seqs))
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()   # the steps before have been collected: nothing else runs
        if REFUSED in _burst_step(engine, total):
            return 0
        best = max(best, total / (time.perf_counter() - t0))
    return int(best)


def gpu_kv_budget(device: torch.device, utilization: float, activation_bytes: int) -> int:
    """Bytes the pool may take: this process's share of the GPU (`utilization` of its
    memory), less what this process holds now (weights) and the step's activations, and
    never more than is free (other processes on the same GPU keep theirs)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    mine = torch.cuda.memory_reserved(device)
    budget = min(int(utilization * total) - mine, free - (256 << 20)) - activation_bytes
    log.info("GPU %s: %.1f of %.1f GiB free, %.2f GiB held here; %.2f GiB kept for activations; "
             "%.2f GiB for KV", device, free / 2**30, total / 2**30, mine / 2**30, activation_bytes / 2**30,
             max(budget, 0) / 2**30)
    return max(budget, 0)

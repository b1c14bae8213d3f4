"""One sampling step for a batch of sequences of any lengths, on one device.

Rows new to this engine prefill their ids; rows it has cached decode from their last
token. The engine places every row in the paged pool before the forward pass: a row
needs blocks for its new positions. When the free blocks do not cover the step,
sequences outside the step are evicted, least recently used first (`take_evicted` lists
them for the router). If that is still not enough, rows of the step itself are refused,
prefills first (largest first), then decode rows from the end of the batch; a refused row
loses its KV here and samples nothing (its token is REFUSED). A step never fails for
want of memory.

Sizing the pool from the device's memory and warming the kernels up are startup.py's.

The forward pass is a runner's (the `Runner` protocol of `runners/protocol.py`): the fast
runner (`runners/graph.py` over a family of `models/`) on a GPU, or the portable
transformers runner (`runners/hf.py`) for every other model and the CPU.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from qmigrate.engine.batch import StepBatch
from qmigrate.engine.kv.host_tier import export_by_keys, tier_stats
from qmigrate.engine.kv.pool import BlockPool, landed
from qmigrate.engine.rows import REFUSED, Pending, StepRow, prompt_budget, share_prompt_budget
from qmigrate.engine import fp8, placement, prefill, startup, step_sampling
from qmigrate.engine.config import EngineConfig
from qmigrate.engine.runners.choice import make_runner
from qmigrate.engine.controls import Controls, ControlTable
from qmigrate.engine.grammar import GrammarTable
from qmigrate.engine.sampling import HostRows, host_arrays
from qmigrate.engine import logprobs as lp
from qmigrate.hub.shape import ModelShape
from qmigrate.ops.trace import OFF

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048   # positions of a model whose config does not say


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, *, tp=None, use_runner=None, own_model=False,
                 load_format: str = "auto", **overrides):
        """`tp`: this process's rank of a tensor-parallel group (parallel.sharding.TensorParallel); the
        model is then the whole checkpoint on the CPU on rank 0, and on the other ranks may be
        its structure only (meta tensors: scatter.py sends their shards); the runner keeps
        this rank's shard on tp.device; with `load_format` "dummy" every rank's model is its
        structure only and each makes its own shard of dummy weights (parallel/dummy_shard.py).
        Without it (tensor_parallel_size 1) nothing here differs from one device. `use_runner`:
        a Runner built elsewhere (one that skips the model, to time what surrounds the forward
        pass) in place of the one the settings choose. `own_model`:
        the caller hands the model over and drops it after: on a GPU the checkpoint's tensors the
        fast runner does not hold (those it fused into copies, those FP8 replaced) are freed
        before the KV pool is sized, so the pool gets their memory."""
        cfg = self.config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.shape = shape = ModelShape.of_model(model)
        self.tp = tp
        self.max_context = shape.max_context or DEFAULT_CONTEXT
        self.max_len = min(cfg.max_model_len or self.max_context, self.max_context)
        param = next(model.parameters())
        self.device, self.dtype = (param.device if tp is None else tp.device), param.dtype
        self.kv_dtype = fp8.kv_dtype(cfg.kv_cache_dtype, self.dtype)
        for what, on, need in ((f"quantization {cfg.quantization}", cfg.quantization != "none", (9, 0)),
                               (f"kv_cache_dtype {cfg.kv_cache_dtype}", cfg.kv_cache_dtype != "auto", (8, 9))):
            if on and (why := fp8.unsupported(self.device, what, need)):
                raise ValueError(why)
        if self.device.type == "cuda":
            # Triton launches and CUDA graph captures go to the current device: make it ours
            torch.cuda.set_device(self.device)
        self.runner, self.runner_reason = ((use_runner, "given") if use_runner is not None
                                           else make_runner(model, cfg, self.device, tp, load_format))
        if own_model and tp is None and use_runner is None and self.device.type == "cuda":
            startup.release_checkpoint(self.runner, model)
        # the pool holds this rank's KV heads (all of them without tensor parallelism)
        self.pool_kv_heads = shape.num_kv_heads if tp is None else tp.layout.kv_heads_per_rank
        self.pool = BlockPool(shape.num_layers, self.pool_kv_heads, shape.head_dim,
                              self._num_blocks(), cfg.block_size, self.kv_dtype, self.device,
                              prefix_cache=cfg.enable_prefix_caching, can_copy=tp is None or tp.world == 1)
        startup.attach_tier(self)
        self.runner.attach(self.pool)
        self.num_continued = 0   # steps built the array way (`_continue`)
        self.prefill_tokens_per_s = 0   # one prefill step's rate, timed by warm_up (0: not timed)
        self.controls = ControlTable(self.shape.vocab_size, self.max_len, self.device)
        self.grammars = GrammarTable(self.shape.vocab_size, self.device)   # structured output's matchers
        self.trace = OFF   # the worker's step timeline (ops/trace.py), when it keeps one
        if tp is not None and tp.world > 1 and tp.is_leader:
            from qmigrate.engine.parallel.lockstep import Leader
            self.runner = Leader(self.runner, self)   # every step and KV move is sent to the others first

    # --- sizing -------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token of the whole model (all ranks: what a transfer ships)."""
        return self.shape.kv_bytes_per_token(self.kv_dtype.itemsize)

    def _num_blocks(self) -> int:
        blocks = startup.num_blocks_here(self)
        # every rank's pool has as many blocks as the smallest can hold: rank 0 places for all
        return blocks if self.tp is None else self.tp.min_int(blocks)

    def describe(self) -> str:
        return startup.describe(self)

    # --- KV store -------------------------------------------------------------------------
    def cached_len(self, seq_id: int) -> int:
        return self.pool.cached_len(seq_id)

    def release(self, seq_id: int) -> None:
        self.pool.release(seq_id)
        self.controls.forget(seq_id)
        self.grammars.forget(seq_id)

    def set_controls(self, seq_id: int, controls: Controls, ids, prompt_len: int) -> None:
        """A sequence's sampling controls, and its ids so far (its penalties count them)."""
        self.controls.set(seq_id, controls, ids, prompt_len)

    def set_grammar(self, seq_id: int, fresh, eos_ids, generated) -> bool:
        """A sequence's fresh grammar matcher (`grammars.matcher`: a `hub.grammars.Copy`), with
        its generated ids replayed; False when they do not follow it."""
        return self.grammars.set(seq_id, fresh, eos_ids, generated)

    def take_evicted(self) -> list[int]:
        return self.pool.take_evicted()

    @property
    def free_tokens(self) -> int:
        return self.pool.free_tokens

    def export_kv(self, seq_id: int, num_tokens: int | None = None, start: int = 0) -> torch.Tensor:
        return landed(*self.export_kv_started(seq_id, num_tokens, start))

    def export_kv_started(self, seq_id: int, num_tokens: int | None = None,
                          start: int = 0) -> tuple[torch.Tensor, object]:
        """The KV of positions [start, num_tokens) (all it holds by default), and the CUDA
        event after which the tensor holds it (None: it does now)."""
        return self.runner.export_kv(seq_id, num_tokens, start)

    def export_prefix_started(self, keys: list[int]) -> tuple[torch.Tensor | None, object]:
        """The KV of the leading blocks of `keys` cached here (either tier), for another
        worker to start a sequence on; and the CUDA event after which the tensor holds it."""
        if self.tp is not None and self.tp.world > 1:
            return None, None   # a rank holds only its share of the heads
        return export_by_keys(self.pool, keys)

    def import_kv(self, seq_id: int, kv: torch.Tensor, protect=frozenset(), start: int = 0) -> bool:
        """Shipped KV for seq_id; it never joins this worker's prefix cache (BlockPool.load)."""
        return self.runner.import_kv(seq_id, kv, protect, start)

    @property
    def can_import_from(self) -> bool:
        """Shipped KV may start past position 0 (on its cached prefix): not across tensor-parallel ranks."""
        return self.pool.is_caching and (self.tp is None or self.tp.world == 1)

    def admit(self, seq_id: int, ids, salt: str = "") -> int:
        """Start seq_id on the longest cached prefix of `ids`; the positions it starts with."""
        return self.pool.admit(seq_id, ids, salt)

    def prefix_stats(self) -> dict[str, int]:
        """Prompt tokens admitted and the part of them found cached, and blocks cached now."""
        return self.pool.prefix.stats()

    def take_prefix_events(self) -> list[int]:
        """Keys of blocks cached (key) and evicted (~key) since the last call."""
        return self.pool.prefix.take_events()

    def grow_tier(self) -> bool:
        """Page-lock one more chunk of the host tier (`HostTier.grow`), for a worker with nothing
        to run; False when there is no tier or it is whole."""
        return self.pool.tier is not None and self.pool.tier.grow()

    def take_tier_events(self) -> list[int]:
        """Keys of blocks the host tier took (key) and dropped (~key) since the last call."""
        return [] if self.pool.tier is None else self.pool.tier.take_events()

    def tier_stats(self) -> dict[str, int]:
        """Per tier, blocks held and hits, and bytes moved through the host tier (protocol's
        TIER_STATS names); empty without a host tier."""
        return tier_stats(self.pool)

    # --- a step -------------------------------------------------------------------------
    PROMPT_LIMITS = ("prefill_tokens_per_step", "prefill_tokens_with_decode", "prefill_spread_steps")

    def set_prompt_limits(self, **limits: int) -> None:
        """Change how many prompt tokens later steps carry (the PROMPT_LIMITS settings). They
        shape what a step takes, not what was sized or captured for it, so they may change
        between steps (the admission benchmark times one prompt under several)."""
        unknown = sorted(set(limits) - set(self.PROMPT_LIMITS))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a prompt limit; those are {', '.join(self.PROMPT_LIMITS)}")
        bad = [k for k, v in limits.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise ValueError(f"{bad[0]} must be an integer >= 0, got {limits[bad[0]]!r}")
        self.config = dataclasses.replace(self.config, **limits)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A few prefills and decode steps of throwaway rows, so that kernels are compiled
        (and their caches loaded) before the first real request waits on them, then one prefill
        step timed (`prefill_tokens_per_s`: the router costs a recompute by it). Only on a GPU:
        the CPU runs no compiled kernels, and there it would only cost time."""
        if self.device.type != "cuda":
            return
        config = self.config
        self.config = dataclasses.replace(config, prefill_tokens_per_step=0, prefill_tokens_with_decode=0,
                                          prefill_spread_steps=0)
        try:
            startup.warm_up(self)
            self.prefill_tokens_per_s = startup.prefill_rate(self)
        finally:
            self.config = config

    def step(self, rows: list[StepRow]) -> list[int]:
        """Run one step for every row; the sampled token of each, in row order (REFUSED
        for a row the pool had no room for)."""
        return self.collect(self.launch(rows))

    @torch.inference_mode()
    def launch(self, rows: list[StepRow], after: "Pending | None" = None, between=None) -> "Pending":
        """Start a step on the device and return without waiting for its tokens.

        A row with no new_ids feeds the token that the step `after` (launched before, not
        necessarily collected) samples for the same sequence: the host builds step N+1
        while the device still runs step N, and that token never visits the host.

        A prompt longer than `prefill_chunk` fills its KV a chunk at a time before the step
        proper, with `between()` called after each chunk (a worker's heartbeat), so no single
        forward pass grows with the prompt.

        With `prefill_tokens_per_step` (or `prefill_tokens_with_decode` while a row decodes),
        the step's prompt rows (several new ids) share that many tokens in row order: a row
        past the budget runs only its first part, or none of it. Such a row's sequence is in
        `Pending.partial`: its token is no sample (the KV of the part that ran is kept), and a
        later step carries the rest from cached_len on."""
        if any(r.new_ids for r in rows):
            # before any forward pass of this step's prompts: those may replay a graph whose
            # output holds the logits `after` waits to sample
            step_sampling.settle(self, after)
        else:   # `_run` settles it at the latest: its masks are filled while this step is built
            self.settle(after)
            if after is not None and after.batch is not None and rows:
                pending = self._continue(rows, after)
                if pending is not None:
                    return pending
        feed = [i for i, r in enumerate(rows) if not r.new_ids]
        if feed and (after is None or not self.runner.can_feed):
            known = dict(zip((r.seq_id for r in after.rows), self.collect(after))) if after else {}
            rows = [dataclasses.replace(r, new_ids=[known.get(r.seq_id, REFUSED)]) if not r.new_ids else r
                    for r in rows]
            feed = []
        bad = [i for i in feed if after.row_of.get(rows[i].seq_id) is None]
        if bad or any(r.new_ids and r.new_ids[0] == REFUSED for r in rows):
            raise ValueError("a row feeds a token its previous step did not sample")
        rows, cached = prefill.admit_prompts(self, rows)
        rows, refused_whole, prompt_lps = prefill.prompt_pass(self, rows, between)
        rows, cut, deferred = share_prompt_budget(rows, prompt_budget(rows, self.config))
        rows, refused = prefill.prefill_chunks(self, rows, between, skip=deferred)
        refused |= refused_whole
        kept = [i for i in range(len(rows)) if i not in refused and i not in deferred]
        placed = [kept[k] for k in self.place([rows[i] for i in kept], {r.seq_id for r in rows})]
        pending = Pending(rows, placed, {rows[i].seq_id: k for k, i in enumerate(placed)}, cached=cached)
        pending.prompt_logprobs = {sid: v for sid, v in prompt_lps.items() if sid in pending.row_of}
        if cut or deferred:
            pending.partial = {rows[i].seq_id for i in deferred} | {rows[i].seq_id for i in cut
                                                                   if rows[i].seq_id in pending.row_of}
        if not placed:
            return pending
        run = [rows[i] for i in placed]
        batch = StepBatch.build(self.pool, [r.seq_id for r in run], [r.new_ids or [0] for r in run],
                                [r.start for r in run])
        fed = [k for k, r in enumerate(run) if not r.new_ids]
        feed = (fed, [after.row_of[run[k].seq_id] for k in fed]) if fed else None
        params = host_arrays([r.temperature for r in run], [r.top_p for r in run], [r.top_k for r in run],
                             [r.seed for r in run], [r.index for r in run])
        asks = np.fromiter((r.num_logprobs for r in run), dtype=np.int32, count=len(run))
        pending.asks = asks if (asks >= 0).any() else None
        return self._run(pending, batch, feed, params, after)

    def _continue(self, rows: list[StepRow], after: "Pending") -> "Pending | None":
        """The common decode step, built with array operations: every row is a sequence of
        the step `after`, one token further, with the sampling parameters it had there.
        None when that does not hold or a new block cannot be had without evicting (the
        general path then places the rows, refusing some if it must)."""
        pool, prev, row_of = self.pool, after.batch, after.row_of
        n = len(rows)
        seq_ids = [r.seq_id for r in rows]
        src = np.fromiter((row_of.get(s, -1) for s in seq_ids), dtype=np.int64, count=n)
        if (src < 0).any() or len(set(seq_ids)) != n:
            return None
        starts = np.fromiter((r.start for r in rows), dtype=np.int64, count=n)
        index = np.fromiter((r.index for r in rows), dtype=np.int64, count=n)
        temperature, top_p, top_k, seed, prev_index = (a[src] for a in after.params)
        length = pool.length
        given = host_arrays(*([getattr(r, f) for r in rows] for f in ("temperature", "top_p", "top_k", "seed")),
                            index)  # compared as the arrays hold them (float32 parameters)
        if (not (prev.seq_lens[src] == starts).all() or not (prev_index + 1 == index).all()
                or int(starts.max()) + 1 > self.max_len
                or any(length.get(s) != p for s, p in zip(seq_ids, starts.tolist()))
                or not all((a == b).all() for a, b in zip(given, (temperature, top_p, top_k, seed)))):
            return None
        bs = pool.block_size
        opening = [i for i in np.flatnonzero(starts % bs == 0).tolist()
                   if len(pool.blocks[seq_ids[i]]) * bs <= starts[i]]
        if opening and not pool.make_room(len(opening), set(seq_ids)):
            return None
        for i in opening:
            pool.grow(seq_ids[i], int(starts[i]) + 1)
        for s in seq_ids:
            pool.touch(s)
        batch = prev.continued(pool, seq_ids, src)
        if self.runner.can_feed:
            feed = (np.arange(n), src)
        else:
            batch.ids = np.asarray(self.collect(after), dtype=np.int64)[np.asarray(after.placed)[src]]
            feed = None
        pending = Pending(rows, list(range(n)), dict(zip(seq_ids, range(n))))
        pending.asks = after.asks[src] if after.asks is not None else None
        self.num_continued += 1
        return self._run(pending, batch, feed, (temperature, top_p, top_k, seed, index), after)

    def _run(self, pending: "Pending", batch: StepBatch, feed, params: HostRows, after=None) -> "Pending":
        """Queue the forward pass and sampling of the placed rows; tokens come back to a
        pinned host buffer without a wait. Rows with a grammar have their masks computed
        while the device runs the forward pass. When one of them samples after a token that
        the step `after` has not yet brought to the host, the sampling waits until `after` is
        collected (`step_sampling.note_collected` starts its masks) and its masks are filled
        (`step_sampling.settle`), while the device runs the forward pass.

        `feed`: (rows, their rows in `after`) of the rows fed a token `after` samples. A decode
        step (`_continue`) settles `after` here, not before it is built, so that the masks are
        filled while the host builds it."""
        step_sampling.settle(self, after)   # its tokens are read on the device from here on
        if feed is not None:
            feed = (*feed, after.tokens)
        logits = self.runner.forward(batch, feed=feed)
        pending.batch, pending.params = batch, params
        if self.grammars and after is not None and after.result is None \
                and self.grammars.lags(batch.seq_ids, params[4], pending.row_of):
            pending.logits, pending.waits_on, after.then = logits, after, pending
        else:
            masks = self.grammars.masks(batch.seq_ids, params[4], pending.row_of) if self.grammars else None
            step_sampling.queue(self, pending, logits, masks)
        # the rows' ids, unless every row decodes a token not yet known here
        some_known = feed is None or len(feed[0]) < batch.num_rows
        self.pool.mark_written(batch.seq_ids, batch.seq_lens,
                               (pending.rows[i] for i in pending.placed) if some_known else None)
        return pending

    def settle(self, pending: "Pending | None") -> None:
        """Queue the sampling of a step that waits for its masks if they are filled, never
        waiting for them: a worker asks as it goes through its own work on the step before, so
        that the sampling runs on the device while the worker builds the next step (which
        otherwise settles it, waiting if it must, just before its forward pass: `_run`)."""
        step_sampling.settle(self, pending, wait=False)

    def take_logprobs(self, pending: "Pending") -> tuple[dict, dict]:
        """Of a collected step: seq_id -> (values, top ids, row) of each asking row's sampled
        token (a reference into the step's arrays: wire/packed.py), and seq_id -> (values, top
        ids) of each prompt whose logprobs it computed (numpy arrays: engine/logprobs.py)."""
        return lp.taken(pending)

    def place(self, rows: list[StepRow], protect=()) -> list[int]:
        """Blocks for every row that can have them; the indices of the rows that run.
        Sequences in `protect` (and the rows') are never evicted for room."""
        return placement.place(self.pool, rows, self.max_len, protect)

    def collect(self, pending: "Pending", while_waiting=None) -> list[int]:
        """Wait for a launched step: its sampled tokens in row order (the step's one host sync).
        `while_waiting()` is called until the step is done, for as long as it returns True."""
        step_sampling.settle(self, pending)
        if pending.result is None:
            tokens = [REFUSED] * len(pending.rows)
            if pending.placed:
                if pending.event is not None:
                    if while_waiting is not None:
                        while not pending.event.query() and while_waiting():
                            pass
                        if pending.result is not None:   # collected by what while_waiting launched
                            return pending.result
                    pending.event.synchronize()
                values = (pending.host if pending.host is not None else pending.tokens).tolist()
                for i, token in zip(pending.placed, values):
                    tokens[i] = token
                if pending.batch is not None:   # a row cut short (partial) sampled no token of its sequence
                    self.pool.note_sampled(pending.batch.seq_ids, pending.batch.seq_lens, values, pending.partial)
                    step_sampling.note_collected(self, pending, values)
            pending.result = tokens
        return pending.result

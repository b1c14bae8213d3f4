"""Structured output in the step: a grammar matcher per constrained sequence, and each step's
token mask for the rows that have one.

A sequence's matcher is rebuilt from what travels with it, never kept from one worker's past:
when a worker takes the full form it compiles the grammar (`hub.grammars.Compiler`: a pool
thread, cached by grammar; the worker hands the sequence back until it is ready) and replays
the sequence's generated ids through a fresh matcher. After that the matcher follows the tokens
the steps sample, as `Engine.collect` hands them over; a step that asks for generated token i
of a sequence whose matcher has consumed more (a step the router dropped) rolls it back first.
So recompute, KV transfer and a step that ran twice all find the same grammar state, and the
same mask.

The mask is computed on the host while the device runs the step's forward pass (the step is
queued before the mask is asked for), into a pinned buffer of packed bits (one int32 per 32
tokens, llguidance's layout), and applied on the device as one masked fill of the constrained
rows. A step whose constrained rows sample after a token of the step before it that is still
on the device (`lags`) is sampled once that step is collected (`Engine._note_grammars`): the
matchers take its tokens and the masks are filled by a job (`start`) on this table's thread, in
two calls of the library's thread pool (the rows handed to it family by family of their
templates: hub/grammars.py), while the worker's own thread does its work on the collected
step; the sampling is queued as soon as the worker finds the job done, and at the latest when
the step after is launched or the step is collected (`finish`). Rows without a grammar pay
nothing of this; a step with no constrained row does no work here. EOS is in a row's mask only
where its grammar accepts.

What a mask costs depends on the grammar's state, not only on the row count: llguidance skips
whole slices of the vocabulary where the lexer allows any string character, but a string with a
`maxLength` (or any lexeme the slices do not cover) walks the token trie: on random walks
through `bench serve`'s schema, 0.21 ms a row on average and 0.86 ms at the 99th percentile on
the 2-core CPU machine (`python -m benchmarks.grammar_libs --walk 128`; `docs/bench/mask_cost.py`
by schema).
"""

from __future__ import annotations

import functools
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

log = logging.getLogger(__name__)

JOB_SWITCH_S = 1e-4   # the interpreter's switch interval while a step's grammar job runs on its thread


class GrammarTable:
    """The matchers of the constrained sequences a worker holds."""

    def __init__(self, vocab_size: int, device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.compiler = None          # hub.grammars.Compiler, set by whoever has the tokenizer
        self.matchers: dict[int, list] = {}   # seq_id -> [matcher, tokens consumed, EOS ids, family]
        self.executor = None          # llguidance's thread pool
        self.thread = None            # the one thread that runs a step's job (`start`)
        self.job: MaskJob | None = None   # the job in progress, if any
        self.switch_s = 0.0           # the interpreter's switch interval to restore once it ends
        self.width = 0                # int32 words of a row's mask

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def matcher(self, grammar: str, eos_ids):
        """A fresh matcher of `grammar` (GrammarError: it does not compile, or not in time)."""
        from qmigrate.hub.grammars import GrammarError
        if self.compiler is None:
            raise GrammarError("this worker has no tokenizer for structured output")
        return self.compiler.matcher(grammar, eos_ids)

    def ready(self, grammar: str, eos_ids):
        """A fresh matcher, or None while its grammar compiles on the pool (GrammarError: it
        does not compile, or not in time)."""
        from qmigrate.hub.grammars import GrammarError
        if self.compiler is None:
            raise GrammarError("this worker has no tokenizer for structured output")
        return self.compiler.ready(grammar, eos_ids)

    def set(self, seq_id: int, fresh, eos_ids, generated) -> bool:
        """Take a sequence's fresh matcher (a `hub.grammars.Copy`) and replay its generated ids;
        False when they do not follow the grammar (the sequence cannot go on under it)."""
        self.forget(seq_id)
        matcher = fresh.matcher
        generated = [int(t) for t in generated]
        if generated and not matcher.consume_tokens(generated):
            log.warning("sequence %d: its %d generated ids do not follow its grammar: %s", seq_id,
                        len(generated), matcher.get_error())
            return False
        self.matchers[seq_id] = [matcher, len(generated), sorted(eos_ids), fresh.family]
        self.width = self.width or self.compiler.mask_words(eos_ids)
        return True

    def forget(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def _at(self, entry: list, index: int) -> bool:
        """Bring a matcher back to `index` tokens consumed; False when it has fewer."""
        if entry[1] > index:
            entry[0].rollback(entry[1] - index)
            entry[1] = index
        return entry[1] == index

    def lags(self, seq_ids, index) -> bool:
        """Whether a constrained row samples past what its matcher has consumed (its last token
        is still on the device)."""
        self.wait()
        matchers = self.matchers
        return any(s in matchers and matchers[s][1] < i for s, i in zip(seq_ids, np.asarray(index).tolist()))

    def note(self, seq_ids, index, tokens, partial=frozenset()) -> None:
        """The tokens a step sampled: row k's is generated token index[k] of seq_ids[k]."""
        self.wait()
        self._take(self._takes(seq_ids, index, tokens, partial))

    def _takes(self, seq_ids, index, tokens, partial) -> list[tuple[list, int, int]]:
        """(entry, seq_id, token) of each row whose matcher is to take its token (brought back
        to the token's place first, where a step ran twice)."""
        matchers, out = self.matchers, []
        for s, i, t in zip(seq_ids, np.asarray(index).tolist(), tokens):
            entry = matchers.get(s)
            if entry is not None and s not in partial and self._at(entry, i):
                out.append((entry, s, int(t)))
        return out

    def _take(self, takes, taken=None) -> None:
        """Count the tokens the matchers took (`taken`: whether each did; None: take them here)."""
        for (entry, s, t), ok in zip(takes, taken if taken is not None else (e[0].consume_token(t) for e, _, t in takes)):
            if ok:
                entry[1] += 1
            else:
                log.warning("sequence %d: token %d does not follow its grammar: %s", s, t, entry[0].get_error())

    def masks(self, seq_ids, index, noted=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, packed bits) of a step's constrained rows, on the device; None when it has none.
        `noted`: (seq_ids, index, tokens, partial) of the step before, just collected, which
        the matchers take first (`note`)."""
        return self.finish(self.start(seq_ids, index, noted, now=True))

    def start(self, seq_ids, index, noted=None, now: bool = False) -> "MaskJob":
        """Begin what `masks` does on this table's own thread (`now`: on the caller's), and
        return at once; `finish` gives the masks. The matchers take `noted`'s tokens and fill
        the masks in two calls of the library's thread pool, which hold no interpreter lock:
        the caller goes on with its own work on the collected step meanwhile. Until then, any
        other use of the matchers waits for them (`wait`)."""
        self.wait()
        takes = self._takes(*noted) if noted is not None else []
        matchers = self.matchers
        index = np.asarray(index).tolist()
        rows = [k for k, s in enumerate(seq_ids) if s in matchers]
        taking = {id(e) for e, _, _ in takes}
        if any(matchers[seq_ids[k]][1] + (id(matchers[seq_ids[k]]) in taking) > index[k] for k in rows):
            self._take(takes)   # a row goes back after its token (a step ran twice): take them first
            takes, taking = [], set()
        bits = self._buffer(len(rows))
        pairs = []
        for j, k in enumerate(rows):
            entry = matchers[seq_ids[k]]
            at = entry[1] + 1 if id(entry) in taking else entry[1]
            if at != index[k] and (id(entry) in taking or not self._at(entry, index[k])):
                log.warning("sequence %d: its grammar is %d tokens behind; only EOS is allowed",
                            seq_ids[k], index[k] - at)
                bits[j] = 0
                continue
            pairs.append((entry[0], j, entry[3]))
        # the rows in order of their template's family, so that each of the library's threads
        # takes a run of rows sharing a lock (hub/grammars.py) rather than every thread waiting
        # on each lock in turn
        pairs.sort(key=lambda p: p[2])
        job = MaskJob(rows, [matchers[seq_ids[k]][2] for k in rows], bits, takes, [p[:2] for p in pairs])
        if now or (len(pairs) <= 1 and len(takes) <= 1):   # little to do: not worth a thread's turn
            job.taken = job.run(self._executor(len(pairs), len(takes)))
        else:
            if self.thread is None:
                self.thread = ThreadPoolExecutor(1, thread_name_prefix="masks")
            job.future = self.thread.submit(job.run, self._executor(len(pairs), len(takes)))
            self.job = job
            # The thread needs the interpreter lock between the library's calls, while this one
            # runs the worker's Python: at the default switch interval (5 ms) it would wait
            # until this thread blocks, and nothing would overlap.
            self.switch_s = self.switch_s or sys.getswitchinterval()
            sys.setswitchinterval(JOB_SWITCH_S)
        return job

    def _executor(self, *counts: int):
        """llguidance's thread pool, made on first need (None while every call has one row)."""
        if self.executor is None and max(counts) > 1:
            import llguidance
            from qmigrate.hub.grammars import mask_threads
            self.executor = llguidance.LLExecutor(mask_threads())
        return self.executor

    def wait(self) -> None:
        """Let the job in progress end, and count the tokens its matchers took."""
        job, self.job = self.job, None
        try:
            if job is not None and job.future is not None:
                job.taken, job.future = job.future.result(), None
        finally:
            if self.switch_s:
                sys.setswitchinterval(self.switch_s)
                self.switch_s = 0.0
        if job is not None:
            self._counted(job)

    def _counted(self, job: "MaskJob") -> None:
        if job.takes is not None:
            self._take(job.takes, job.taken)
            job.takes = None

    def finish(self, job: "MaskJob") -> tuple[torch.Tensor, torch.Tensor] | None:
        """The masks of a job from `start`, on the device (None: the step has no constrained row)."""
        if job is self.job:
            self.wait()
        self._counted(job)
        if not job.rows:
            return None
        bits = job.bits
        host = bits.numpy().view(np.uint32)
        for j in np.flatnonzero(~host.any(axis=1)).tolist():   # nothing allowed (ended, or lost): EOS
            for t in job.eos[j]:
                host[j, t >> 5] |= np.uint32(1 << (t & 31))
        dev_rows = torch.tensor(job.rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return dev_rows, bits.to(self.device, non_blocking=True)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """A step's host bitmask: pinned on a GPU, where the caching host allocator hands a
        block out again only once the copy that read it has run."""
        return torch.empty(num_rows, self.width, dtype=torch.int32, pin_memory=self.device.type == "cuda")


class MaskJob:
    """One step's grammar work (`GrammarTable.start`): the tokens its matchers take, then its
    constrained rows' masks."""

    def __init__(self, rows: list[int], eos: list, bits: torch.Tensor, takes: list, pairs: list) -> None:
        self.rows, self.eos, self.bits = rows, eos, bits   # the constrained rows, their EOS ids
        self.takes = takes          # (entry, seq_id, token); None once counted
        self.tokens = [(e[0], t) for e, _, t in takes]   # (matcher, token), as the library takes them
        self.pairs = pairs          # (matcher, row of bits) of the rows to fill
        self.taken: list[bool] | None = None
        self.future = None

    def ready(self) -> bool:
        """Whether the library's calls have ended (`finish` then does not wait)."""
        return self.future is None or self.future.done()

    def run(self, executor) -> list[bool]:
        """The library's calls only (whether each token was taken): the tokens, then the masks."""
        takes, pairs, bits = self.tokens, self.pairs, self.bits
        taken = executor.consume_token_par(takes) if len(takes) > 1 else [m.consume_token(t) for m, t in takes]
        row_bytes = bits.shape[1] * 4
        if len(pairs) > 1:
            executor.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), row_bytes, bits.shape[0])
        elif pairs:
            matcher, j = pairs[0]
            matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), row_bytes)
        return taken


@functools.lru_cache(maxsize=8)
def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, device=device, dtype=torch.int32)


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token a constrained row's grammar forbids at -inf (in place)."""
    shifts = _shifts(bits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :logits.shape[1]]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits

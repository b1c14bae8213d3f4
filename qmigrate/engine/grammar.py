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
on the device (`lags`) is sampled once that step is collected: collecting it
(`Engine._note_grammars`) starts a job on the table's own thread (`start`), where the matchers
take its tokens and the masks are filled (by the library's threads, the rows handed to them
family by family of their templates: hub/grammars.py). Meanwhile the worker does its own work on
the collected step and builds the next one; launching that one (or collecting the waiting
step) takes the masks (`finish`) and queues the sampling, just before the next forward pass.
Rows without a grammar pay nothing of this; a step with no constrained row does no work here.
EOS is in a row's mask only where its grammar accepts.

What a mask costs depends on the grammar's state, not only on the row count: llguidance skips
whole slices of the vocabulary where the lexer allows any string character, but a string with a
`maxLength` (or any lexeme the slices do not cover) walks the token trie: on random walks
through `bench serve`'s schema, 0.21 ms a row on average and 0.86 ms at the 99th percentile on
the 2-core CPU machine (`python -m benchmarks.grammar_libs --walk 128`; `docs/bench/mask_cost.py`
by schema).
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0002   # the longest a thread keeps the interpreter's lock while another waits (`start`)


class GrammarTable:
    """The matchers of the constrained sequences a worker holds."""

    def __init__(self, vocab_size: int, device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.compiler = None          # hub.grammars.Compiler, set by whoever has the tokenizer
        self.matchers: dict[int, list] = {}   # seq_id -> [matcher, tokens consumed, EOS ids, family]
        self.executor = None
        self.jobs = None              # one thread: a step's masks filled beside the worker's own work
        self.job = None               # the last job asked for (a Future)
        self.buffers: list[torch.Tensor] = []  # two pinned bitmasks, used in turn
        self.turn = 0
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
        self._join()
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
        self._join()
        matchers = self.matchers
        return any(s in matchers and matchers[s][1] < i for s, i in zip(seq_ids, np.asarray(index).tolist()))

    def note(self, seq_ids, index, tokens, partial=frozenset()) -> None:
        """The tokens a step sampled: row k's is generated token index[k] of seq_ids[k]. Several
        rows take theirs on the library's threads, family by family (as `masks` fills them)."""
        self._join()
        self._note(seq_ids, index, tokens, partial)

    def _note(self, seq_ids, index, tokens, partial=frozenset()) -> None:
        matchers, taking = self.matchers, []
        for s, i, t in zip(seq_ids, np.asarray(index).tolist(), tokens):
            entry = matchers.get(s)
            if entry is None or s in partial or not self._at(entry, i):
                continue
            taking.append((entry[3], s, entry, int(t)))
        if len(taking) > 1:
            taking.sort(key=lambda x: x[0])
            taken = self._executor().consume_token_par([(entry[0], t) for _, _, entry, t in taking])
        else:
            taken = [entry[0].consume_token(t) for _, _, entry, t in taking]
        for (_, s, entry, t), ok in zip(taking, taken):
            if ok:
                entry[1] += 1
            else:
                log.warning("sequence %d: token %d does not follow its grammar: %s", s, t, entry[0].get_error())

    def _executor(self):
        if self.executor is None:
            import llguidance
            from qmigrate.hub.grammars import mask_threads
            self.executor = llguidance.LLExecutor(mask_threads())
        return self.executor

    def masks(self, seq_ids, index) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, packed bits) of a step's constrained rows, on the device; None when it has none."""
        self._join()
        return self._on_device(self._host_masks(seq_ids, index, None))

    def start(self, seq_ids, index, noted) -> Future:
        """`masks`, on a thread of the table's: the matchers take the tokens `noted` and fill the
        masks there while the caller goes on (the library's calls leave the interpreter's lock);
        `finish` takes them. Jobs run in the order asked, and every other call on the table
        waits for the last one first, so the matchers are never used from two places at once
        (`forget` only drops a sequence from the table: a job in flight has its entries)."""
        self._join()
        if self.jobs is None:   # on a GPU the thread's device is the table's (its pinned buffers)
            on_gpu = self.device.type == "cuda"
            self.jobs = ThreadPoolExecutor(1, thread_name_prefix="masks",
                                           initializer=(lambda: torch.cuda.set_device(self.device)) if on_gpu else None)
            # The job holds the interpreter's lock only between the library's calls, but it waits
            # for it while the worker's thread runs Python: by default up to 5 ms at each turn,
            # longer than the whole job, so it would start only once the worker waits for it.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.job = self.jobs.submit(self._timed, seq_ids, index, noted)
        return self.job

    def finish(self, job: Future) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, float]:
        """The masks of a job `start` began, on the device (waits for it), and the seconds the
        job took on its thread."""
        host, took = job.result()
        return self._on_device(host), took

    def _timed(self, seq_ids, index, noted):
        began = time.perf_counter()
        return self._host_masks(seq_ids, index, noted), time.perf_counter() - began

    def _join(self) -> None:
        job = self.job
        if job is not None:
            self.job = None
            wait([job])   # its outcome (an error too) is the caller of `finish`'s

    def _on_device(self, host) -> tuple[torch.Tensor, torch.Tensor] | None:
        if host is None:
            return None
        rows, bits = host
        dev_rows = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return dev_rows, bits.to(self.device, non_blocking=True)

    def _host_masks(self, seq_ids, index, noted) -> tuple[list[int], torch.Tensor] | None:
        """(rows, packed bits in a pinned buffer) of a step's constrained rows; None: none.
        `noted`: (seq_ids, index, tokens, partial) of the step before, just collected, which
        the matchers take first (`note`), or None."""
        if noted is not None:
            self._note(*noted)
        matchers = self.matchers
        index = np.asarray(index).tolist()
        entries = [matchers.get(s) for s in seq_ids]
        rows = [k for k, entry in enumerate(entries) if entry is not None]
        if not rows:
            return None
        bits = self._buffer(len(rows))
        pairs = []
        for j, k in enumerate(rows):
            entry = entries[k]
            if not self._at(entry, index[k]):
                log.warning("sequence %d: its grammar is %d tokens behind; only EOS is allowed",
                            seq_ids[k], index[k] - entry[1])
                bits[j] = 0
                continue
            pairs.append((entry[0], j, entry[3]))
        # The library's own calls, not its `llguidance.torch` helpers (importing those compiles a
        # function with torch.compile: seconds of a worker's first constrained step); the rows in
        # order of their template's family, so that each thread takes a run of rows sharing a
        # lock (hub/grammars.py) rather than every thread waiting on each lock in turn.
        row_bytes = bits.shape[1] * 4
        if len(pairs) > 1:
            pairs.sort(key=lambda p: p[2])
            self._executor().unsafe_compute_mask_ptr([p[:2] for p in pairs], bits.data_ptr(), row_bytes, bits.shape[0])
        elif pairs:
            matcher, j, _ = pairs[0]
            matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), row_bytes)
        host = bits.numpy().view(np.uint32)
        for j in np.flatnonzero(~host.any(axis=1)).tolist():   # nothing allowed (ended, or lost): EOS
            for t in entries[rows[j]][2]:
                host[j, t >> 5] |= np.uint32(1 << (t & 31))
        return rows, bits

    def _buffer(self, num_rows: int) -> torch.Tensor:
        width = self.width
        pinned = self.device.type == "cuda"
        self.turn ^= 1
        while len(self.buffers) < 2:
            self.buffers.append(torch.empty(0, width, dtype=torch.int32))
        buf = self.buffers[self.turn]
        if buf.shape[0] < num_rows or buf.shape[1] != width:
            buf = self.buffers[self.turn] = torch.empty(max(num_rows, 2 * buf.shape[0]), width, dtype=torch.int32,
                                                        pin_memory=pinned)
        return buf[:num_rows]


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token a constrained row's grammar forbids at -inf (in place)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :logits.shape[1]]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits

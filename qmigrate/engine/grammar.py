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
queued before the mask is asked for), as packed bits (one int32 per 32 tokens, llguidance's
layout), and applied on the device as one masked fill of the constrained rows. A step whose
constrained rows sample after a token of the step before it that is still on the device
(`lags`) is sampled once that step is collected: collecting it
(`step_sampling.note_collected`) starts a job (`start`) where the matchers are: on a thread of
theirs, or in a process of their own (a GPU worker's, hub/mask_process.py says why). There the matchers
take its tokens and the masks are filled (by the library's threads, the rows handed to them
family by family of their templates: hub/grammars.py).

On a GPU that takes waits on host memory (engine/device_wait.py), the worker then takes no part:
the processes write the masks into memory shared with them (hub/mask_shared.py) and then
a counter word, and the worker queues at once, behind the step's forward pass, the device's
wait for each process's word, the copies of the masks and the sampling (`_queued`,
`device_wait.DeviceMasks`), and goes on to build the next step. Only the device waits, and
only when the masks outlast the forward pass; a watch thread releases it if a process ends
or stops answering (the worker stops at its next call here). Elsewhere the masks come back into a pinned buffer, and the
worker asks as it does its own work on the collected step whether they are filled
(`Engine.settle`): once they are, it takes them (`finish`) and queues the sampling, so that the
device samples while the worker builds the next step; at the latest, that step's forward
pass waits for them.
Rows without a grammar pay nothing of this; a step with no constrained row does no work here.
EOS is in a row's mask only where its grammar accepts.

What a mask costs depends on the grammar's state, not only on the row count: llguidance skips
whole slices of the vocabulary where the lexer allows any string character, but a string with a
`maxLength` (or any lexeme the slices do not cover) walks the token trie: on random walks
through `bench serve`'s schema, 0.15 ms a row on average on the 2-core CPU machine, against
xgrammar's 0.017 (`python -m benchmarks.grammar_libs --walk 32`). So a JSON schema with a
length-bounded string compiles with xgrammar (hub/grammars.py says which, and why).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from qmigrate.engine.device_wait import DeviceMasks, Waits
from qmigrate.hub.mask_process import ANSWER_TIMEOUT_S, MaskProcess, MaskShards
from qmigrate.hub.masks import TRAILER_BYTES, MaskThread


class GrammarTable:
    """The matchers of the constrained sequences a worker holds: in this process, a step's masks
    filled on a thread (`MaskThread`), or in a process of their own or several (`use_process`:
    `MaskProcess`, `MaskShards`), behind the same calls (hub/masks.py, hub/mask_process.py),
    their masks written to memory the device waits on where it can.
    What each matcher has consumed is also counted here, on the worker's thread, so that a
    step knows without asking whether its constrained rows wait for the step before it (`lags`)."""

    def __init__(self, vocab_size: int, device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.compiler = None          # hub.grammars.Compiler, set by whoever has the tokenizer
        self.counts: dict[int, int] = {}   # seq_id -> tokens its matcher has consumed
        self.matchers: MaskThread | MaskProcess | MaskShards = MaskThread()
        self.buffers: list[tuple] = []  # two pinned (bitmasks, rows) and their numpy views, used in turn
        self.turn = 0
        self.width = 0                # int32 words of a row's mask
        self.device_masks: DeviceMasks | None = None   # masks the device waits for (`use_process`)
        self.last_shared = None       # the processes' handle of the last such job (its seconds, once answered)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def use_process(self, tokenizer_path, trust_remote_code: bool, timeout_s: float, processes: int = 1,
                    rows: int = 0, waits: Waits | None = None) -> None:
        """Keep the matchers in a process of their own from now on (before any is set), or
        spread over `processes` of them. `rows` > 0: a step of up to that many constrained rows
        has its masks written by the processes into memory shared with them, and the device
        waits for them (`waits`: the driver's calls, made here for a GPU that takes them)."""
        assert not self.counts, "matchers already set here"
        if processes > 1:
            self.matchers = MaskShards(processes, tokenizer_path, trust_remote_code, self.vocab_size, timeout_s)
        else:
            self.matchers = MaskProcess(tokenizer_path, trust_remote_code, self.vocab_size, timeout_s)
        if self.compiler is not None:   # this process's copies only prove that a grammar compiles
            self.compiler.family_size = 1
        waits = (waits or Waits.make(self.device)) if rows > 0 else None
        if waits is not None:   # a process's own answer timeout: the same
            self.device_masks = DeviceMasks(waits, rows, ANSWER_TIMEOUT_S + timeout_s, self.device)

    def _processes(self) -> list:
        return getattr(self.matchers, "shards", [self.matchers])

    def close(self) -> None:
        if self.device_masks is not None:
            self.device_masks.close()
        self.matchers.join()
        self.matchers.close()

    def _shared(self, num_rows: int) -> DeviceMasks | None:
        """The masks the device waits for, where a step of num_rows constrained rows may use them
        (their regions made at the first such step)."""
        masks = self.device_masks
        if masks is None or num_rows > masks.rows or not self.width:
            return None
        if masks.regions is None and not masks.open(self._processes(), self.width):
            self.device_masks = None
            return None
        return masks

    def _check(self) -> None:
        if self.device_masks is not None:
            self.device_masks.check()

    def _compiler(self, grammar: str, eos_ids):
        from qmigrate.hub.grammars import GrammarError
        if self.compiler is None:
            raise GrammarError("this worker has no tokenizer for structured output")
        self.matchers.warm(grammar, eos_ids)
        return self.compiler

    def matcher(self, grammar: str, eos_ids):
        """A fresh matcher of `grammar` (GrammarError: it does not compile, or not in time)."""
        return self._compiler(grammar, eos_ids).matcher(grammar, eos_ids)

    def ready(self, grammar: str, eos_ids):
        """A fresh matcher, or None while its grammar compiles on the pool (GrammarError: it
        does not compile, or not in time)."""
        return self._compiler(grammar, eos_ids).ready(grammar, eos_ids)

    def set(self, seq_id: int, fresh, eos_ids, generated) -> bool:
        """Take a sequence's fresh matcher (a `hub.grammars.Copy`) and replay its generated ids;
        False when they do not follow the grammar (the sequence cannot go on under it)."""
        self._check()
        self.matchers.join()
        self.forget(seq_id)
        generated = [int(t) for t in generated]
        ok = self.matchers.set(seq_id, fresh, eos_ids, generated)
        if ok:
            self.counts[seq_id] = len(generated)
            self.width = self.width or self.compiler.mask_words(eos_ids)
        return ok

    def forget(self, seq_id: int) -> None:
        """Drop a sequence (a job in flight still fills its row: nothing waits for it)."""
        if self.counts.pop(seq_id, None) is not None:
            self.matchers.forget(seq_id)

    def _constrained(self, seq_ids, row_of=None) -> list[tuple[int, int]]:
        """(row, seq_id) of a step's constrained rows, in row order; `row_of` (seq_id -> row:
        the step's `Pending.row_of`) saves a pass over every row when few are constrained."""
        counts = self.counts
        if row_of is not None and len(counts) < len(row_of):
            return sorted((row_of[s], s) for s in counts if s in row_of)
        return [(k, s) for k, s in enumerate(seq_ids) if s in counts]

    def lags(self, seq_ids, index, row_of=None) -> bool:
        """Whether a constrained row samples past what its matcher has consumed (its last token
        is still on the device)."""
        counts = self.counts
        return any(counts[s] < index[k] for k, s in self._constrained(seq_ids, row_of))

    def _noted(self, seq_ids, index, tokens, partial=frozenset(), row_of=None):
        """The constrained rows of a step's sampled tokens (row k's is generated token index[k]
        of seq_ids[k]), as (seq_ids, index, tokens) lists, or None; counted as consumed."""
        counts, taken = self.counts, ([], [], [])
        for k, s in self._constrained(seq_ids, row_of):
            if s in partial:
                continue
            i = int(index[k])
            taken[0].append(s)
            taken[1].append(i)
            taken[2].append(int(tokens[k]))
            if counts[s] >= i:   # a matcher ahead of the row goes back first; one behind it stays there
                counts[s] = i + 1
        return taken if taken[0] else None

    def _rows(self, seq_ids, index, row_of=None) -> tuple[list[int], list[int], list[int]]:
        """(rows, their seq_ids, their index) of a step's constrained rows, in the order the
        matchers fill them (`arrange`: row order, or process by process)."""
        found = self.matchers.arrange(self._constrained(seq_ids, row_of))
        rows = [k for k, _ in found]
        return rows, [s for _, s in found], np.asarray(index)[rows].tolist()

    def note(self, seq_ids, index, tokens, partial=frozenset(), row_of=None) -> None:
        """The tokens a step sampled: row k's is generated token index[k] of seq_ids[k]."""
        self._check()
        noted = self._noted(seq_ids, index, tokens, partial, row_of)
        if noted is not None:
            self.matchers.note(noted)

    def masks(self, seq_ids, index, row_of=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, packed bits) of a step's constrained rows, on the device; None when it has none."""
        return self.finish(self.start(seq_ids, index, None, row_of))[0]

    def start(self, seq_ids, index, noted, row_of=None) -> "Job":
        """`masks`, filled beside the caller: the matchers take the tokens `noted` (`note`'s
        arguments) and fill the masks on their thread, or in their process, while the caller
        goes on (the library's calls leave the interpreter's lock); `finish` takes them. Jobs
        run in the order asked."""
        self._check()
        taken = self._noted(*noted) if noted is not None else None
        rows, ids, index = self._rows(seq_ids, index, row_of)
        if not rows and taken is None:   # nothing to take and no row to fill: the matchers are not asked
            return Job(None, None, None, [])
        bits, at, host, host_rows, answer = self._buffer(len(rows))
        host_rows[:] = rows
        shared = self._shared(len(rows))
        if shared is None:
            return Job(at, bits, self.matchers.start(taken, ids, index, host, answer))
        number = shared.next()
        handle = self.matchers.start(taken, ids, index, host, None, self.turn, number)   # (answers read first)
        before, self.last_shared = self.last_shared, handle
        took = self.matchers.result(before) if before is not None else 0.0
        runs = self.matchers.runs(ids) if len(shared.regions) > 1 else [(0, len(ids))]
        return Job(at, bits, handle, shared.plan(runs, self.turn, number), took)

    def done(self, job: "Job") -> bool:
        """Whether a job's masks are filled (`finish` would not wait): always, for masks the
        device waits for, and for a job with nothing to ask."""
        return job.plan is not None or self.matchers.ready(job.handle)

    def finish(self, job: "Job") -> tuple[tuple[torch.Tensor, torch.Tensor] | None, float]:
        """The masks of a job `start` began, on the device (waits for it), and the seconds the
        job took where it ran; masks the device waits for are queued at once (behind a wait for
        each process's word), and the seconds given are those of the shared job before it (its
        answer read by then)."""
        if job.plan is not None:
            return self._queued(job), job.took
        took = self.matchers.result(job.handle)
        if not len(job.rows):
            return None, took
        # both from pinned memory: a copy from pageable memory may wait for the step in flight
        return (job.rows.to(self.device, non_blocking=True), job.bits.to(self.device, non_blocking=True)), took

    def _queued(self, job: "Job") -> tuple[torch.Tensor, torch.Tensor] | None:
        """A shared job's masks on the device, queued behind the device's wait for each
        process's word (the process's answer, the trailer, is read at the next call that joins it)."""
        if not job.plan:   # no row: nothing to wait for
            return None
        bits = self.device_masks.queue(job.plan, len(job.rows), self.width)
        return job.rows.to(self.device, non_blocking=True), bits

    def _buffer(self, num_rows: int) -> tuple:
        """The next turn's bits [num_rows, width] (int32) and rows [num_rows] (int64), pinned on a
        GPU, numpy views of them (uint32 bits), and the bytes from the bits on that the process's
        answer fills: a job's buffers stay untouched until the job after next, when its copies
        are done."""
        width = self.width
        self.turn ^= 1
        while len(self.buffers) < 2:
            self.buffers.append(self._allocate(0, width))
        bits, rows, host, host_rows, whole = self.buffers[self.turn]
        if bits.shape[0] < num_rows or bits.shape[1] != width:
            bits, rows, host, host_rows, whole = self.buffers[self.turn] = self._allocate(
                max(num_rows, 2 * bits.shape[0]), width)
        answer = whole.reshape(-1)[:num_rows * width * 4 + TRAILER_BYTES]   # the process's answer: rows, trailer
        return bits[:num_rows], rows[:num_rows], host[:num_rows], host_rows[:num_rows], answer

    def _allocate(self, size: int, width: int) -> tuple:
        """Rows of bits past `size` hold the matchers' process's trailer (hub/mask_process.py)."""
        pinned = self.device.type == "cuda" and size > 0
        spare = -(-TRAILER_BYTES // (4 * width)) if width else 0
        whole = torch.empty(size + spare, width, dtype=torch.int32, pin_memory=pinned)
        rows = torch.empty(size, dtype=torch.int64, pin_memory=pinned)
        return whole[:size], rows, whole.numpy().view(np.uint32)[:size], rows.numpy(), whole.numpy().view(np.uint8)


class Job(NamedTuple):
    """A step's masks being filled (`GrammarTable.start`): its constrained rows and the rows
    of bits they go to (pinned), the thread's Future or the processes' jobs, and for masks the
    device waits for, per process with rows: (its word's device address, the fill's number,
    its region's turn, the first and end row of its run), and the seconds the shared job before
    it took where it ran; an empty plan, no rows, for a job the matchers were not asked for."""
    rows: torch.Tensor
    bits: torch.Tensor
    handle: object
    plan: list | None = None
    took: float = 0.0


_SHIFTS: dict = {}   # device -> int32 [0..31], the bit of each token in its word


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token a constrained row's grammar forbids at -inf (in place)."""
    shifts = _SHIFTS.get(bits.device)
    if shifts is None:
        shifts = _SHIFTS[bits.device] = torch.arange(32, device=bits.device, dtype=torch.int32)
    forbidden = ((bits[:, :, None] >> shifts) & 1).eq(0).view(bits.shape[0], -1)[:, :logits.shape[1]]
    logits.index_put_((rows,), logits.index_select(0, rows).masked_fill_(forbidden, float("-inf")))
    return logits

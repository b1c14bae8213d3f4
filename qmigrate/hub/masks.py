"""Structured output's matchers and their token masks, importable without torch (xgrammar's
matchers, where a sequence has one, bring it: hub/grammars.py says which library): the
matchers of the constrained sequences a worker holds (`Matchers`), and a thread of the
worker's that fills a step's masks beside its own work (`MaskThread`, the CPU's default). A
GPU worker keeps them in a process of their own, or several, behind the same calls
(hub/mask_process.py says why).
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

log = logging.getLogger(__name__)

TRAILER_BYTES = 16              # after a step's masks: the seconds they took, and 1.0 if filling failed
SWITCH_INTERVAL_S = 0.0002      # the longest a thread keeps the interpreter's lock while another waits


# a sequence's entry (Matchers.entries): its matcher, the tokens it consumed, its EOS ids, its
# template's family, xgrammar's `allowed` (None: llguidance's matcher), and whether an xgrammar
# matcher's last token is its EOS
MATCHER, CONSUMED, EOS, FAMILY, ALLOWED, ENDED = range(6)


class Matchers:
    """The matchers of the constrained sequences, by sequence: what each has consumed, and
    each step's masks of packed bits (one 32-bit word per 32 tokens, llguidance's layout)."""

    def __init__(self, threads: int | None = None) -> None:
        self.entries: dict[int, list] = {}   # seq_id -> its entry (MATCHER, CONSUMED, ... above)
        self.threads = threads      # the libraries' threads (None: hub/grammars.py's mask_threads)
        self.executor = None        # llguidance's threads
        self.batch = None           # xgrammar's

    def set(self, seq_id: int, fresh, eos_ids, generated) -> bool:
        """Take a sequence's fresh matcher (a `hub.grammars.Copy`) and replay its generated ids;
        False when they do not follow the grammar (the sequence cannot go on under it)."""
        self.entries.pop(seq_id, None)
        matcher = fresh.matcher
        generated = [int(t) for t in generated]
        if fresh.allowed is not None:   # xgrammar's
            taken = all(matcher.accept_token(t) for t in generated)
        else:
            taken = not generated or matcher.consume_tokens(generated)
        if not taken:
            log.warning("sequence %d: its %d generated ids do not follow its grammar: %s", seq_id,
                        len(generated), _error(matcher))
            return False
        ended = fresh.allowed is not None and matcher.is_terminated()
        self.entries[seq_id] = [matcher, len(generated), sorted(eos_ids), fresh.family, fresh.allowed, ended]
        return True

    def forget(self, seq_id: int) -> None:
        self.entries.pop(seq_id, None)

    @staticmethod
    def _ended(entry: list, index: int) -> bool:
        """Whether a matcher took its EOS before generated token `index`: rows of a step built
        before the EOS was seen. They take no token (counted, one would make a later rollback
        go too far) and allow only EOS (xgrammar has no mask there). An xgrammar matcher ends
        only by taking an EOS, which `note` sees (asking it costs a call a row a step)."""
        if entry[CONSUMED] > index:
            return False
        return entry[ENDED] if entry[ALLOWED] is not None else entry[MATCHER].is_stopped()

    @staticmethod
    def _at(entry: list, index: int) -> bool:
        """Bring a matcher back to `index` tokens consumed; False when it has fewer."""
        if entry[CONSUMED] > index:
            entry[MATCHER].rollback(entry[CONSUMED] - index)
            entry[CONSUMED] = index
            entry[ENDED] = False   # nothing follows an EOS: going back takes it back
        return entry[CONSUMED] == index

    def note(self, seq_ids, index, tokens) -> None:
        """The tokens a step sampled for its constrained rows: seq_ids[k]'s generated token
        index[k] is tokens[k]. Several rows take theirs on the library's threads, family by
        family (as `fill` fills them)."""
        taking, xtaking = [], []
        for s, i, t in zip(seq_ids, index, tokens):
            entry = self.entries.get(s)
            if entry is None or self._ended(entry, i):
                continue
            if self._at(entry, i):
                (taking if entry[ALLOWED] is None else xtaking).append((entry[FAMILY], s, entry, int(t)))
        if len(taking) > 1:
            taking.sort(key=lambda x: x[0])
            taken = self._executor().consume_token_par([(entry[MATCHER], t) for _, _, entry, t in taking])
        else:
            taken = [entry[MATCHER].consume_token(t) for _, _, entry, t in taking]
        if xtaking:
            import xgrammar
            taken += xgrammar.BatchGrammarMatcher.batch_accept_token([e[MATCHER] for _, _, e, _ in xtaking],
                                                                     [t for _, _, _, t in xtaking])
        for (_, s, entry, t), ok in zip(taking + xtaking, taken):
            if ok:
                entry[CONSUMED] += 1
                if entry[ALLOWED] is not None and t in entry[EOS]:
                    entry[ENDED] = True
            else:
                log.warning("sequence %d: token %d does not follow its grammar: %s", s, t, _error(entry[MATCHER]))

    def _executor(self):
        if self.executor is None:
            import llguidance
            from qmigrate.hub.grammars import mask_threads
            self.executor = llguidance.LLExecutor(self.threads or mask_threads())
        return self.executor

    def _fill_xgrammar(self, xpairs, bits: np.ndarray) -> None:
        """xgrammar's rows (matcher, row, allowed): filled on its threads, each then ANDed with
        the tokens a JSON text may hold (hub/xgrammar_json.py)."""
        if self.batch is None:
            import xgrammar
            from qmigrate.hub.grammars import mask_threads
            self.batch = xgrammar.BatchGrammarMatcher(max_threads=self.threads or mask_threads())
        rows = [j for _, j, _ in xpairs]
        self.batch.batch_fill_next_token_bitmask([m for m, _, _ in xpairs], bits.view(np.int32), indices=rows)
        allowed = xpairs[0][2]
        if all(a is allowed for _, _, a in xpairs):   # one tokenizer: every row at once
            if rows[-1] - rows[0] == len(rows) - 1:   # (in order, as they come:) a slice, not a gather
                bits[rows[0]:rows[-1] + 1] &= allowed
            else:
                bits[rows] &= allowed
        else:
            for _, j, a in xpairs:
                bits[j] &= a

    def fill(self, seq_ids, index, bits: np.ndarray) -> None:
        """Row j of `bits` (uint32, C-ordered) becomes the mask of seq_ids[j] at its generated
        token index[j]: what its grammar allows, only EOS where it allows nothing (ended, or a
        matcher behind its sequence), every token for a sequence it does not know."""
        pairs, xpairs, eos_only = [], [], []
        for j, (s, i) in enumerate(zip(seq_ids, index)):
            entry = self.entries.get(s)
            if entry is None:   # dropped while its step's masks were asked for
                log.debug("sequence %d: no grammar here; its row is not constrained", s)
                bits[j] = 0xFFFFFFFF
            elif self._ended(entry, i):
                eos_only.append(j)
            elif not self._at(entry, i):
                log.warning("sequence %d: its grammar is %d tokens behind; only EOS is allowed", s, i - entry[CONSUMED])
                eos_only.append(j)
            elif entry[ALLOWED] is None:
                pairs.append((entry[MATCHER], j, entry[FAMILY]))
            else:
                xpairs.append((entry[MATCHER], j, entry[ALLOWED]))
        if xpairs:
            self._fill_xgrammar(xpairs, bits)
        # The library's own calls, not its `llguidance.torch` helpers (importing those compiles a
        # function with torch.compile: seconds of a worker's first constrained step); the rows in
        # order of their template's family, so that each thread takes a run of rows sharing a
        # lock (hub/grammars.py) rather than every thread waiting on each lock in turn.
        row_bytes = bits.shape[1] * 4
        if len(pairs) > 1:
            pairs.sort(key=lambda p: p[2])
            self._executor().unsafe_compute_mask_ptr([p[:2] for p in pairs], bits.ctypes.data, row_bytes,
                                                     bits.shape[0])
        elif pairs:
            matcher, j, _ = pairs[0]
            matcher.unsafe_compute_mask_ptr(bits[j].ctypes.data, row_bytes)
        if pairs or xpairs:
            eos_only += np.flatnonzero(~bits.any(axis=1)).tolist()
        for j in eos_only:
            bits[j] = 0
            entry = self.entries.get(seq_ids[j])   # (a drop may take it meanwhile on the worker's thread)
            for t in entry[EOS] if entry is not None else ():
                bits[j, t >> 5] |= np.uint32(1 << (t & 31))


def _error(matcher) -> str:
    """Why a matcher refused a token, where its library says (xgrammar does not)."""
    return matcher.get_error() if hasattr(matcher, "get_error") else "refused by its grammar"


class MaskThread:
    """The matchers in the worker's own process, behind `MaskProcess`'s calls: a step's masks
    filled on a thread of their own (`grammar_masks: thread`, the CPU's default). Every call
    but `forget` waits for the job in flight first, so the matchers are never used from two
    threads at once (a sequence dropped meanwhile only leaves its row unconstrained)."""

    def __init__(self) -> None:
        self.matchers = Matchers()
        self.jobs = None              # one thread: a step's masks filled beside the worker's own work
        self.job = None               # the last job asked for (a Future)

    def warm(self, grammar: str, eos_ids) -> None:
        """Nothing to do: the worker's compiler builds what `set` is given."""

    @staticmethod
    def arrange(found: list) -> list:
        """A step's constrained (row, seq_id) in the order their masks are asked for."""
        return found

    def set(self, seq_id: int, fresh, eos_ids, generated) -> bool:
        self.join()
        return self.matchers.set(seq_id, fresh, eos_ids, generated)

    def forget(self, seq_id: int) -> None:
        self.matchers.forget(seq_id)

    def note(self, noted) -> None:
        self.join()
        self.matchers.note(*noted)

    def start(self, noted, seq_ids, index, bits: np.ndarray, answer: np.ndarray) -> Future:
        """Fill the masks of seq_ids (at index) into `bits` (uint32 rows) on the thread, after
        the matchers take `noted` (`note`'s lists, or None); `result` waits for them."""
        self.join()
        if self.jobs is None:
            self.jobs = ThreadPoolExecutor(1, thread_name_prefix="masks")
            # The job holds the interpreter's lock only between the library's calls, but it waits
            # for it while the worker's thread runs Python: by default up to 5 ms at each turn,
            # longer than the whole job, so it would start only once the worker waits for it.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.job = self.jobs.submit(self._fill, noted, seq_ids, index, bits)
        return self.job

    def _fill(self, noted, seq_ids, index, bits) -> float:
        began = time.perf_counter()
        if noted is not None:
            self.matchers.note(*noted)
        self.matchers.fill(seq_ids, index, bits)
        return time.perf_counter() - began

    def result(self, job: Future) -> float:
        """Wait for a job's masks; the seconds it took on the thread."""
        return job.result()

    def ready(self, job: Future) -> bool:
        return job.done()

    def join(self) -> None:
        job, self.job = self.job, None
        if job is not None:
            wait([job])   # its outcome (an error too) is the caller of `result`'s

    def close(self) -> None:
        self.join()

"""How llguidance's masks scale with threads: ROWS matchers of `bench serve`'s builtin schema (compact,
as the server compiles it) walk the same random tokens in several identical sets, and each set's
masks are filled a different way every step: the library's executor with N threads, and a pool of N
Python threads each filling a contiguous share of the rows (the library drops the GIL while it
computes a mask). Every way fills the same states, so the per-step times compare directly.

    python docs/bench/grammar_threads.py TOKENIZER_DIR [ROWS] [STEPS] [THREADS,...]
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def main() -> None:
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer
    from qmigrate.bench.serve_data import BUILTIN_SCHEMA
    from qmigrate.hub.grammars import from_response_format
    path = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    counts = [int(n) for n in (sys.argv[4] if len(sys.argv) > 4 else "1,4,12").split(",")]
    tok = AutoTokenizer.from_pretrained(path)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    grammar, _ = from_response_format({"type": "json_schema",
                                       "json_schema": {"name": "t", "schema": BUILTIN_SCHEMA, "strict": True}})
    words = (lltok.vocab_size + 31) // 32
    ways = [("executor", n) for n in counts] + [("threads", n) for n in counts if n > 1]
    sets = {w: [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)] for w in ways}
    bits = {w: np.zeros((rows, words), dtype=np.int32) for w in ways}
    executors = {n: llguidance.LLExecutor(num_threads=n) for n in counts}
    pools = {n: ThreadPoolExecutor(n) for n in counts if n > 1}
    spent = dict.fromkeys(ways, 0.0)
    rng = np.random.default_rng(0)

    def share(matchers, out, lo, hi):
        for j in range(lo, hi):
            matchers[j].unsafe_compute_mask_ptr(out[j].ctypes.data, words * 4)

    for _ in range(steps):
        for way in ways:
            kind, n = way
            matchers, out = sets[way], bits[way]
            t0 = time.perf_counter()
            if kind == "executor":
                executors[n].unsafe_compute_mask_ptr([(m, j) for j, m in enumerate(matchers)], out.ctypes.data,
                                                     words * 4, rows)
            else:
                cuts = np.linspace(0, rows, n + 1).astype(int)
                list(pools[n].map(lambda k: share(matchers, out, cuts[k], cuts[k + 1]), range(n)))
            spent[way] += time.perf_counter() - t0
        first = bits[ways[0]]
        assert all((b == first).all() for b in bits.values()), "the ways filled different masks"
        drawn = []
        for j in range(rows):
            allowed = np.flatnonzero(np.unpackbits(first[j].view(np.uint8), bitorder="little")[:len(tok)])
            drawn.append(int(rng.choice(allowed)))
        for matchers in sets.values():
            for m, t in zip(matchers, drawn):
                m.consume_token(t)
    print(f"masks of {rows} rows a step, {steps} steps, vocabulary {len(tok):,}, "
          f"{len(os.sched_getaffinity(0))} cores; ms a step")
    for (kind, n), s in spent.items():
        print(f"  {kind:9s} {n:3d} threads {s / steps * 1e3:8.2f}")


if __name__ == "__main__":
    main()

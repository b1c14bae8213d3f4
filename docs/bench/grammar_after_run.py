"""Whether a schema run leaves a grammar's templates slower: the masks of 25 rows of `bench serve`'s
builtin schema, each row a random walk through its own mask, timed a step at a time through
llguidance's executor as the engine calls it (engine/grammar.py); once on a fresh compiler, then
after BIG_ROWS rows walked the same compiler's templates for BIG_STEPS tokens (as a `cost.sh`
schema run does before the mix), then on a fresh compiler again. The walks of 25 rows are the
same walk each time (seed 1), so only the compiler's state differs.

    python docs/bench/grammar_after_run.py TOKENIZER_DIR [BIG_ROWS] [BIG_STEPS]
"""
import sys, time
import numpy as np, torch, llguidance
from transformers import AutoTokenizer
from qmigrate.bench.serve_data import BUILTIN_SCHEMA
from qmigrate.hub import grammars

tok = AutoTokenizer.from_pretrained(sys.argv[1]); eos = [tok.eos_token_id]; vocab = len(tok)
big_rows = int(sys.argv[2]) if len(sys.argv) > 2 else 256
big_steps = int(sys.argv[3]) if len(sys.argv) > 3 else 600
grammar, _ = grammars.from_response_format({"type": "json_schema", "json_schema": {"name": "b", "schema": BUILTIN_SCHEMA, "strict": True}})
ex = llguidance.LLExecutor(grammars.mask_threads())
print("mask threads", grammars.mask_threads(), flush=True)

def walk(c, rows, steps, seed, settle=0.0):
    first = c.matcher(grammar, eos)
    time.sleep(settle)
    copies = [first] + [c.matcher(grammar, eos) for _ in range(rows - 1)]
    width = c.mask_words(eos)
    bits = torch.zeros(rows, width, dtype=torch.int32)
    rng = np.random.default_rng(seed)
    times = []
    order = sorted(range(rows), key=lambda j: copies[j].family)
    pairs = [(copies[j].matcher, j) for j in order]
    for _ in range(steps):
        t0 = time.perf_counter()
        ex.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), width * 4, rows)
        times.append(time.perf_counter() - t0)
        host = bits.numpy().view(np.uint32)
        for j in range(rows):
            nz = np.flatnonzero(host[j])
            w = int(rng.choice(nz)); word = int(host[j][w])
            b = int(rng.choice([k for k in range(32) if word >> k & 1]))
            copies[j].matcher.consume_token(w * 32 + b)
    fam = {len(v) for v in c.families.values()}
    t = np.array(times) * 1e3
    return f"{rows} rows x {steps} steps: mask a step p50 {np.median(t):.2f} p90 {np.percentile(t, 90):.2f} mean {t.mean():.2f} ms; family {fam}"

c1 = grammars.Compiler(lambda: tok, vocab, 60.0)
print("A fresh compiler, copies at once:", walk(c1, 25, 60, 1), flush=True)
t0 = time.time()
print("B schema run:", walk(c1, big_rows, big_steps, 2), f"({time.time() - t0:.0f} s)", flush=True)
print("C after it, same compiler:", walk(c1, 25, 60, 1), flush=True)
c2 = grammars.Compiler(lambda: tok, vocab, 60.0)
print("D fresh compiler, family grown first:", walk(c2, 25, 60, 1, settle=1.0), flush=True)
print("E fresh compiler again, 25 x 60 twice:", walk(c2, 25, 60, 1), flush=True)

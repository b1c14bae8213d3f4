"""A step's masks through `Matchers` (the path a worker's matchers take), each library on the
same schemas: `bench serve`'s builtin schema (strings of at most 24 characters) and the same
without `maxLength`. ROWS sequences walk STEPS steps, each sampling uniformly among what its
mask allows; prints each library's fill and note (taking the step's tokens) times a step.

Usage: python docs/bench/mask_libs.py MODEL_DIR [ROWS] [STEPS]
"""
import json
import sys
import time

import numpy as np

from qmigrate.bench.serve_data import BUILTIN_SCHEMA
from qmigrate.hub import grammars
from qmigrate.hub.masks import Matchers
from qmigrate.hub.tokenizer_info import load_tokenizer_info


def main() -> None:
    path = sys.argv[1]
    rows, steps = (int(a) for a in (sys.argv[2:4] + ["256", "200"][len(sys.argv) - 2:]))
    eos = load_tokenizer_info(path)[2]
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    open_schema = json.loads(json.dumps(BUILTIN_SCHEMA))
    del open_schema["properties"]["notes"]["items"]["maxLength"]
    routed = grammars.xgrammar_schema
    for library in ("xgrammar", "llguidance"):
        # each schema forced to one library, whatever hub/grammars.py would choose
        grammars.xgrammar_schema = _schema if library == "xgrammar" else (lambda grammar: None)
        for name, schema in (("builtin", BUILTIN_SCHEMA), ("open", open_schema)):
            grammar = grammars.from_structured_outputs({"json": schema})[0]
            compiler = grammars.Compiler(lambda: load_tokenizer_info(path)[0], vocab, 30.0)
            matchers, ids = Matchers(), list(range(rows))
            for s in ids:
                assert matchers.set(s, compiler.matcher(grammar, eos), eos, [])
            width, rng, fills, notes = compiler.mask_words(eos), np.random.default_rng(0), [], []
            for i in range(steps):
                bits = np.zeros((rows, width), np.uint32)
                t = time.perf_counter()
                matchers.fill(ids, [i] * rows, bits)
                fills.append(time.perf_counter() - t)
                allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
                tokens = [int(rng.choice(np.flatnonzero(allowed[r]))) for r in range(rows)]
                t = time.perf_counter()
                matchers.note(ids, [i] * rows, tokens)
                notes.append(time.perf_counter() - t)
            f, n = np.array(fills) * 1e3, np.array(notes) * 1e3
            blocks = [round(float(f[j:j + 50].mean()), 2) for j in range(0, steps, 50)]
            print(f"{library:10s} {name:7s} {rows} rows: fill p50 {np.median(f):.2f} ms mean {f.mean():.2f} "
                  f"(by 50 steps {blocks}); note p50 {np.median(n):.3f} ms", flush=True)
    grammars.xgrammar_schema = routed


def _schema(grammar: str) -> str:
    body = dict(json.loads(grammar)["grammars"][0]["json_schema"])
    body.pop("x-guidance", None)
    return json.dumps(body)


if __name__ == "__main__":
    main()

"""Where a constrained decode step's host time goes, at a batch of ROWS rows each under the same
JSON schema: the matchers taking the step's tokens (`GrammarTable.note`), the masks
(`GrammarTable.masks`, on THREADS threads, default the engine's), and, for comparison, the same
tokens taken by llguidance's parallel `consume_token_par`, and the masks of rows all copied from
one template (a family of one: hub/grammars.py). Tokens are drawn uniformly from each row's mask,
so the rows walk their schemas as a random-weight model under the grammar does.

    python docs/bench/grammar_step.py TOKENIZER_DIR [ROWS] [STEPS] [THREADS]

Prints ms per step for each part and schema, and the cores the process could use.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from qmigrate.bench.serve_data import BUILTIN_SCHEMA
from qmigrate.engine.grammar import GrammarTable
from qmigrate.hub import grammars


def schemas() -> dict[str, dict]:
    open_schema = copy.deepcopy(BUILTIN_SCHEMA)
    open_schema["properties"]["notes"]["items"].pop("maxLength")
    return {"builtin": BUILTIN_SCHEMA, "open": open_schema}


def run(compiler, schema, eos, vocab, rows, steps, par_consume: bool, threads: int, families: int) -> dict[str, float]:
    import llguidance
    grammar, _ = grammars.from_response_format({"type": "json_schema",
                                                "json_schema": {"name": "b", "schema": schema, "strict": True}})
    table = GrammarTable(vocab, torch.device("cpu"))
    table.compiler = compiler
    table.executor = llguidance.LLExecutor(threads)
    compiler.family_size = families
    compiler.families.clear()
    compiler.templates.clear()
    seq_ids = list(range(rows))
    for s in seq_ids:
        table.set(s, compiler.matcher(grammar, eos), eos, [])
    executor = table.executor
    gen = torch.Generator().manual_seed(0)
    shifts = torch.arange(32, dtype=torch.int32)
    spent = {"note": 0.0, "masks": 0.0}
    index = np.zeros(rows, dtype=np.int64)
    tokens = None
    for _ in range(steps):
        t0 = time.perf_counter()
        if tokens is not None:
            if par_consume:
                pairs = [(table.matchers[s][0], t) for s, t in zip(seq_ids, tokens)]
                executor.consume_token_par(pairs)
                for s in seq_ids:
                    table.matchers[s][1] += 1
            else:
                table.note(seq_ids, index - 1, tokens)
        t1 = time.perf_counter()
        _, bits = table.masks(seq_ids, index)
        t2 = time.perf_counter()
        spent["note"] += t1 - t0
        spent["masks"] += t2 - t1
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(rows, -1)[:, :vocab]
        weights = allowed.float()
        tokens = torch.multinomial(weights, 1, generator=gen)[:, 0].tolist()
        index += 1
    return {k: v / steps * 1e3 for k, v in spent.items()}


def main() -> None:
    path = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else grammars.mask_threads()
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab, eos = len(tokenizer), [tokenizer.eos_token_id]
    compiler = grammars.Compiler(lambda: tokenizer, vocab, 120.0)
    print(f"grammar host work of one step, {rows} rows x {steps} steps, vocab {vocab}, "
          f"{len(os.sched_getaffinity(0))} cores usable, {threads} threads")
    for name, schema in schemas().items():
        for par, families in ((False, threads), (True, threads), (False, 1)):
            cost = run(compiler, schema, eos, vocab, rows, steps, par, threads, families)
            how = "consume_token_par" if par else "note (serial)"
            print(f"  {name:8s} tokens taken by {how:18s} {cost['note']:7.2f} ms   "
                  f"masks {cost['masks']:7.2f} ms ({families} template{'s' * (families > 1)})")


if __name__ == "__main__":
    main()

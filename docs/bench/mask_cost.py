"""What llguidance's token mask costs a row, by schema: `bench serve`'s builtin schema (strings
of at most 24 characters), the same without the limit (docs/bench/schema-open.json), and with a
limit of 200. Each of ROWS matchers samples TOKENS tokens from its mask (uniform logits), one row
at a time on one thread, so the figure is CPU time per row and step, whatever the cores.

    python docs/bench/mask_cost.py TOKENIZER_DIR [ROWS] [TOKENS]
"""

from __future__ import annotations

import copy
import sys
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from qmigrate.bench.serve_data import BUILTIN_SCHEMA
from qmigrate.hub import grammars


def variants() -> dict[str, dict]:
    out = {"builtin (maxLength 24)": BUILTIN_SCHEMA}
    for name, limit in (("maxLength 200", 200), ("no maxLength", None)):
        schema = copy.deepcopy(BUILTIN_SCHEMA)
        items = schema["properties"]["notes"]["items"]
        items.pop("maxLength")
        if limit is not None:
            items["maxLength"] = limit
        out[name] = schema
    return out


def cost(compiler, schema: dict, eos: list[int], vocab: int, rows: int, tokens: int) -> tuple[float, float]:
    """(mean, worst) ms of one row's mask."""
    import llguidance.torch as llt
    grammar, _ = grammars.from_response_format({"type": "json_schema",
                                                "json_schema": {"name": "b", "schema": schema, "strict": True}})
    matchers = [compiler.matcher(grammar, eos).matcher for _ in range(rows)]
    bits = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)
    gen, times = torch.Generator().manual_seed(0), []
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(tokens):
        for j, m in enumerate(matchers):
            t0 = time.perf_counter()
            llt.fill_next_token_bitmask(m, bits, j)
            times.append(time.perf_counter() - t0)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(rows, -1)[:, :vocab]
        logits = torch.zeros(rows, vocab).masked_fill(~allowed, float("-inf"))
        drawn = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0].tolist()
        for m, t in zip(matchers, drawn):
            if not m.consume_token(t):
                raise RuntimeError(m.get_error())
    return float(np.mean(times)) * 1e3, float(np.max(times)) * 1e3


def main() -> None:
    path = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab, eos = len(tokenizer), [tokenizer.eos_token_id]
    compiler = grammars.Compiler(lambda: tokenizer, vocab, 120.0)
    print(f"mask of one row, {rows} rows x {tokens} tokens, one thread")
    for name, schema in variants().items():
        mean, worst = cost(compiler, schema, eos, vocab, rows, tokens)
        print(f"  {name:24s} mean {mean:7.3f} ms   worst {worst:6.1f} ms")


if __name__ == "__main__":
    main()

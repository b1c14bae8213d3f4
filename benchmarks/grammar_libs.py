"""The two grammar libraries side by side on the CPU: a JSON schema's compile time and the
per-token mask time over SmolLM2's 49,152-token vocabulary, following a valid document.

    python -m benchmarks.grammar_libs [--model smollm2] [--repeat 3]
    python -m benchmarks.grammar_libs --walk ROWS [--steps N] [--model DIR]

Prints one table (milliseconds). Needs `llguidance` and, for its column, `xgrammar`. With
`--walk`, each library instead runs ROWS matchers of `bench serve`'s builtin schema for N steps
(compact: no free whitespace, OpenAI's separators, as the server compiles it), each row drawing
its next token uniformly from its mask (as a random-weight model under the grammar does), one
row at a time on one thread: the mean and p99 of a row's mask, and the mean over steps of the
slowest row's, which bounds a step whatever the threads.
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin",
            "tags": ["math", "engines", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "01234"}, "active": True}


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def llguidance_times(tok, ids: list[int], repeat: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    wrap = _ms(t0)
    grammar = llguidance.grammar_from("json_schema", json.dumps(SCHEMA))
    compiles, masks = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
        llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)   # the first mask is part of the start
        compiles.append(_ms(t0))
        assert not m.is_error(), m.get_error()
        m.consume_token(ids[0])
        t0 = time.perf_counter()
        for t in ids[1:]:
            llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
            assert m.consume_token(t), m.get_error()
        masks.append(_ms(t0) / (len(ids) - 1))
    return {"tokenizer": wrap, "compile": min(compiles), "first": compiles[0], "mask": min(masks)}


def xgrammar_times(tok, ids: list[int], repeat: int) -> dict[str, float]:
    import xgrammar
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    wrap = _ms(t0)
    compiles, masks = [], []
    for _ in range(repeat):
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        m = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
        m.fill_next_token_bitmask(bitmask)
        compiles.append(_ms(t0))
        m.accept_token(ids[0])
        t0 = time.perf_counter()
        for t in ids[1:]:
            m.fill_next_token_bitmask(bitmask)
            assert m.accept_token(t)
        masks.append(_ms(t0) / (len(ids) - 1))
    return {"tokenizer": wrap, "compile": min(compiles), "first": compiles[0], "mask": min(masks)}


def _walk_stats(times: list[list[float]]) -> dict[str, float]:
    import numpy as np
    flat = np.array([t for step in times for t in step])
    return {"mean": float(flat.mean()), "p99": float(np.percentile(flat, 99)),
            "step_max": float(np.mean([max(step) for step in times])),
            "step_sum": float(np.mean([sum(step) for step in times]))}


def _draw(rng, bits, vocab: int) -> int:
    import numpy as np
    words = np.asarray(bits, dtype=np.uint32)
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])
    return int(rng.choice(allowed))


def llguidance_walk(tok, schema: dict, rows: int, steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import numpy as np
    from qmigrate.hub.grammars import from_response_format
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    grammar, _ = from_response_format({"type": "json_schema",   # as the server compiles it: compact
                                       "json_schema": {"name": "walk", "schema": schema, "strict": True}})
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
    bits = np.zeros((rows, (lltok.vocab_size + 31) // 32), dtype=np.int32)
    rng, times = np.random.default_rng(0), []
    for _ in range(steps):
        step = []
        for j, m in enumerate(matchers):
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits[j].ctypes.data, bits.shape[1] * 4)
            step.append(_ms(t0))
            m.consume_token(_draw(rng, bits[j], len(tok)))
        times.append(step)
    return _walk_stats(times)


def xgrammar_walk(tok, schema: dict, rows: int, steps: int) -> dict[str, float]:
    import numpy as np
    import xgrammar
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                  separators=(", ", ": "))
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = xgrammar.allocate_token_bitmask(rows, info.vocab_size)
    rng, times = np.random.default_rng(0), []
    for _ in range(steps):
        step = []
        for j, m in enumerate(matchers):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, j)
            step.append(_ms(t0))
            if not m.is_terminated():
                m.accept_token(_draw(rng, bitmask[j].numpy(), len(tok)))
        times.append(step)
    return _walk_stats(times)


def _libraries(llguidance_run, xgrammar_run) -> dict[str, dict[str, float]]:
    """Each library's figures; xgrammar's only where it is installed."""
    out = {"llguidance": llguidance_run()}
    try:
        out["xgrammar"] = xgrammar_run()
    except ImportError:
        pass
    return out


def walk(tok, rows: int, steps: int) -> None:
    from qmigrate.bench.serve_data import BUILTIN_SCHEMA
    results = _libraries(lambda: llguidance_walk(tok, BUILTIN_SCHEMA, rows, steps),
                         lambda: xgrammar_walk(tok, BUILTIN_SCHEMA, rows, steps))
    print(f"builtin schema, {rows} rows x {steps} steps, vocabulary {len(tok):,}, one thread; ms")
    print(f"{'library':12} {'row mean':>9} {'row p99':>9} {'step: slowest row':>18} {'step: all rows':>15}")
    for name, r in results.items():
        print(f"{name:12} {r['mean']:9.3f} {r['p99']:9.3f} {r['step_max']:18.2f} {r['step_sum']:15.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--walk", type=int, default=0, metavar="ROWS")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    from transformers import AutoTokenizer
    from qmigrate.hub.loading import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    if args.walk:
        return walk(tok, args.walk, args.steps)
    ids = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    rows = _libraries(lambda: llguidance_times(tok, ids, args.repeat), lambda: xgrammar_times(tok, ids, args.repeat))
    print(f"vocabulary {len(tok):,}, document {len(ids)} tokens; ms")
    print(f"{'library':12} {'tokenizer':>10} {'compile(1st)':>13} {'compile':>9} {'mask/token':>11}")
    for name, r in rows.items():
        print(f"{name:12} {r['tokenizer']:10.1f} {r['first']:13.1f} {r['compile']:9.1f} {r['mask']:11.3f}")


if __name__ == "__main__":
    main()

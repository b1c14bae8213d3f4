"""Greedy agreement between two OpenAI-compatible servers (a tensor-parallel worker against one
GPU, say): the same fixed prompts of random token ids, greedy, EOS ignored, each server's texts
written to a file; then two files compared token by token, up to each answer's first
difference (a difference early in an answer changes everything after it, so tokens past it
are counted as disagreeing).

Texts, not ids, come back over the API, so both are encoded again with the model's tokenizer:
an identical prefix encodes to identical ids.

Run: `python -m benchmarks.agree run --base-url URL --out a.json [--one-at-a-time]` for each
server, then `python -m benchmarks.agree compare --tokenizer MODEL a.json b.json`. A control
for the model's own sensitivity: one server, its calls sent all at once against one at a time
(the batch changes the order of sums).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path


def prompts(count: int, vocab: tuple[int, int], seed: int) -> list[list[int]]:
    """`count` prompts of 32-256 ids drawn from [vocab[0], vocab[1]), the same for a seed."""
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(rng.randrange(32, 257))] for _ in range(count)]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int, int]:
    """(answers identical, tokens agreeing up to each pair's first difference, tokens): the
    tokens of a pair are the longer answer's."""
    same = agreeing = total = 0
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += x == y
        agreeing += n
        total += max(len(x), len(y))
    return same, agreeing, total


async def _complete(base_url: str, ids: list[list[int]], tokens: int, limit: int) -> list[str]:
    import aiohttp
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base_url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        gate = asyncio.Semaphore(limit)

        async def one(prompt: list[int]) -> str:
            body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            async with gate, session.post(f"{base_url}/v1/completions", json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise SystemExit(f"HTTP {resp.status}: {answer}")
                return answer["choices"][0]["text"]
        return await asyncio.gather(*(one(p) for p in ids))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="greedy answers of one server, to a file")
    run.add_argument("--base-url", required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--prompts", type=int, default=32)
    run.add_argument("--tokens", type=int, default=64)
    run.add_argument("--vocab", default="100:30000", help="token ids drawn from MIN:MAX")
    run.add_argument("--seed", type=int, default=7)
    run.add_argument("--one-at-a-time", action="store_true", help="one call at a time instead of all at once")
    cmp = sub.add_parser("compare", help="agreement of two files")
    cmp.add_argument("--tokenizer", required=True, help="the model's directory")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.command == "run":
        lo, hi = (int(v) for v in args.vocab.split(":"))
        ids = prompts(args.prompts, (lo, hi), args.seed)
        texts = asyncio.run(_complete(args.base_url.rstrip("/"), ids, args.tokens,
                                      1 if args.one_at_a_time else len(ids)))
        args.out.write_text(json.dumps({"texts": texts, "tokens": args.tokens}))
        print(f"{args.out}: {len(texts)} answers")
        return
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    a, b = ([tok.encode(t, add_special_tokens=False) for t in json.loads(p.read_text())["texts"]]
            for p in (args.a, args.b))
    same, agreeing, total = agreement(a, b)
    print(f"{args.a} against {args.b}: {same} of {len(a)} answers identical; {agreeing} of {total} tokens "
          f"agree up to the first difference ({agreeing / max(total, 1):.3f})")


if __name__ == "__main__":
    main()

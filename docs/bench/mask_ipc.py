"""The worker's side of a constrained step with the matchers in their own process, on the CPU: the
time to ask for a step's masks (`start`, with the collected step's tokens) and to take them
(`finish`), 256 rows of which K are constrained by a regex, for N steps.
Usage: python docs/bench/mask_ipc.py MODEL_DIR [K] [N] (a model directory with its tokenizer)"""
import sys
import time

import numpy as np
import torch

from qmigrate.engine.grammar import GrammarTable
from qmigrate.hub import grammars
from qmigrate.hub.tokenizer_info import load_tokenizer_info
from qmigrate.ingest.prompts import parse_request

path, k, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 11, int(sys.argv[3]) if len(sys.argv) > 3 else 400
tokenizer, _, eos = load_tokenizer_info(path)
vocab = len(tokenizer)
grammar = parse_request({"prompt": "x", "structured_outputs": {"regex": "[0-9]{2000}"}}, "r", tokenizer=tokenizer,
                        max_context=4096, eos_ids=eos).grammar
t = GrammarTable(vocab, torch.device("cpu"))
t.compiler = grammars.Compiler(lambda: tokenizer, vocab, 60.0)
t.use_process(path, False, 60.0)
seqs = list(range(1, 257))
constrained = seqs[::256 // k][:k]
for s in constrained:
    assert t.set(s, t.matcher(grammar, eos), eos, [])
digit = tokenizer.convert_tokens_to_ids("1")
row_of = {s: i for i, s in enumerate(seqs)}
ask, take = [], []
for step in range(n):
    index = np.full(256, step, dtype=np.int64)
    noted = (seqs, index - 1, [digit] * 256, frozenset(), row_of) if step else None
    a = time.perf_counter()
    job = t.start(seqs, index, noted, row_of)
    b = time.perf_counter()
    time.sleep(0.003)   # the worker's own work: the job is done by then
    c = time.perf_counter()
    t.finish(job)
    d = time.perf_counter()
    ask.append(b - a)
    take.append(d - c)
t.close()
p = lambda xs: f"p50 {sorted(xs)[len(xs) // 2] * 1e6:.0f} us, p90 {sorted(xs)[int(len(xs) * .9)] * 1e6:.0f} us"
print(f"{k} of 256 rows constrained, {n} steps: ask {p(ask[10:])}; take {p(take[10:])}")

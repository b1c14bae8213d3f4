"""GPU-only checks; they skip cleanly on a machine without CUDA."""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_engine_on_cuda_matches_generate_in_fp32(tiny_model_dir):
    from qmigrate.engine.models import load_model
    from qmigrate.engine.runner import Engine, StepRow
    model, _ = load_model(tiny_model_dir, "cuda:0", "float32")
    engine = Engine(model, max_batch=32, runner="hf")  # exact in fp32: the transformers forward
    r = random.Random(3)
    prompts = [[1] + [r.randint(3, 1400) for _ in range(r.randint(1, 50))] for _ in range(12)]
    n = 16
    expected = [_generate(model, p, n) for p in prompts]
    seqs = {i: list(p) for i, p in enumerate(prompts)}
    out = {i: [] for i in seqs}
    cached = {i: 0 for i in seqs}
    active: list[int] = []
    for step in range(n + len(prompts)):
        if step < len(prompts):
            active.append(step)  # a new sequence joins at every step
        rows = [StepRow(i, seqs[i][cached[i]:], cached[i], len(out[i])) for i in active if len(out[i]) < n]
        if not rows:
            break
        for row, token in zip(rows, engine.step(rows)):
            cached[row.seq_id] = len(seqs[row.seq_id])
            seqs[row.seq_id].append(token)
            out[row.seq_id].append(token)
    for i, p in enumerate(prompts):
        got = out[i][: len(expected[i])]
        assert got == expected[i], i


def test_pipeline_on_one_gpu_two_workers_with_kv_transfer(tmp_path, tiny_model_dir, qmigrate):
    from transformers import AutoModelForCausalLM
    data = {"transport": "ipc", "model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "nodes": [{"name": "local", "monitor": True}],
            "router": {"node": "local", "policy": "any", "migration": "transfer"},
            "ingest": {"node": "local", "input": "jsonl"}, "detokenizer": {"node": "local", "output": "jsonl"},
            "workers": [{"name": f"w{i}", "node": "local", "device": "cuda:0", "max_seqs": 8, "runner": "hf",
                         "gpu_memory_utilization": 0.3} for i in (1, 2)]}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(data))
    r = random.Random(5)
    prompts = [{"id": str(i), "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(1, 40))],
                "max_new_tokens": 12} for i in range(16)]
    run = qmigrate("sim", str(path), stdin="".join(json.dumps(p) + "\n" for p in prompts))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "by_transfer" in run.stderr, run.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to("cuda:0").eval()
    finals = run.finals()
    for p in prompts:
        assert finals[p["id"]]["token_ids"] == _generate(model, p["prompt_ids"], 12), p["id"]

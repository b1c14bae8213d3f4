"""GPU-only checks; they skip cleanly on a machine without CUDA."""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _give_back_gpu_memory():
    """An engine sizes its KV pool from the memory that is free: memory this process's
    allocator still caches from an earlier test would starve the next one's workers."""
    yield
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def _generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_engine_on_cuda_matches_generate_in_fp32(tiny_model_dir):
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    model, _ = load_model(tiny_model_dir, "cuda:0", "float32")
    engine = Engine(model, max_num_seqs=32, runner="hf", max_kv_tokens=1 << 14)  # exact in fp32: transformers' forward
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


@pytest.mark.parametrize("runners,migration", [(("hf", "hf"), "transfer"), (("fast", "fast"), "transfer"),
                                               (("fast", "hf"), "recompute")])
def test_pipeline_on_one_gpu_two_workers_migrating(tmp_path, tiny_model_dir, qmigrate, runners, migration):
    from transformers import AutoModelForCausalLM
    data = {"transport": "ipc", "model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "nodes": [{"name": "local", "monitor": True}],
            "router": {"node": "local", "policy": "any", "migration": migration},
            "ingest": {"node": "local", "input": "jsonl"}, "detokenizer": {"node": "local", "output": "jsonl"},
            "workers": [{"name": f"w{i}", "node": "local", "device": "cuda:0", "max_num_seqs": 8, "runner": runner,
                         "gpu_memory_utilization": 0.3} for i, runner in enumerate(runners, 1)]}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(data))
    r = random.Random(5)
    # enough steps that the second worker surely takes some under policy "any", however fast a step
    prompts = [{"id": str(i), "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(1, 40))],
                "max_new_tokens": 40} for i in range(32)]
    run = qmigrate("sim", str(path), stdin="".join(json.dumps(p) + "\n" for p in prompts))
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"by_{migration}" in run.stderr, run.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to("cuda:0").eval()
    finals = run.finals()
    same = sum(finals[p["id"]]["token_ids"] == _generate(model, p["prompt_ids"], 40) for p in prompts)
    # exact with the transformers runner; the fast runner's fp32 kernels may flip a near-tie
    assert same == len(prompts) if runners == ("hf", "hf") else same >= len(prompts) - 3, same


# --- the fast runner against the transformers forward, in bf16 --------------------------

def _logits(engine, rows):
    """Each row's last-token logits from the engine's runner (the pool updated as in a step)."""
    from qmigrate.engine.batch import StepBatch
    placed = engine.place(rows)
    assert placed == list(range(len(rows)))
    batch = StepBatch.build(engine.pool, [r.seq_id for r in rows], [r.new_ids for r in rows],
                            [r.start for r in rows])
    with torch.inference_mode():
        logits = engine.runner.forward(batch).float().clone()
    engine.pool.mark_written([r.seq_id for r in rows], [r.start + len(r.new_ids) for r in rows])
    return logits


@pytest.fixture(scope="module")
def medium_model_dir(tmp_path_factory):
    """A Llama shape with TinyLlama's head layout (head_dim 64, 4 query heads per KV head)."""
    from qmigrate.hub.builders import build_bench_model
    shape = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=1024, vocab_size=4096)
    return build_bench_model(tmp_path_factory.mktemp("models") / "medium", shape_overrides=shape)


def test_fast_runner_matches_the_hf_forward_in_bf16(medium_model_dir):
    """Mixed prefill lengths, then 64 teacher-forced decode steps of 32 rows (CUDA graphs),
    and a decode step of 5 rows (a padded graph bucket): logits within bf16 tolerance,
    greedy choices agree at >= 95% of positions. (Not on the tiny test model: its weights
    are drawn with std 0.5 to make its logits sharp, and bf16 rounding alone moves them
    by several percent, in transformers' own forward as much as in ours.)"""
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    which, path = "medium", medium_model_dir
    model, _ = load_model(path, "cuda:0", "bfloat16")
    fast = Engine(model, runner="fast", max_num_seqs=32, max_kv_tokens=1 << 16)
    hf = Engine(model, runner="hf", max_num_seqs=32, max_kv_tokens=1 << 16)
    assert fast.runner.name == "fast" and hf.runner.name == "hf"
    vocab = model.config.vocab_size
    r = random.Random(7)
    prompts = [[1] + [r.randint(3, vocab - 1) for _ in range(r.randint(1, 200))] for _ in range(32)]
    rows = [StepRow(i, p, 0, 0) for i, p in enumerate(prompts)]
    a, b = _logits(fast, rows), _logits(hf, rows)
    errors = [float((a - b).norm() / b.norm())]
    agree = [(a.argmax(-1) == b.argmax(-1)).float().mean().item()]
    tokens = b.argmax(-1).tolist()
    for step in range(64):
        rows = [StepRow(i, [tokens[i]], len(prompts[i]) + step, step + 1) for i in range(32)]
        a, b = _logits(fast, rows), _logits(hf, rows)
        errors.append(float((a - b).norm() / b.norm()))
        agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
        tokens = b.argmax(-1).tolist()
    rows = [StepRow(i, [tokens[i]], len(prompts[i]) + 64, 65) for i in range(5)]
    a, b = _logits(fast, rows), _logits(hf, rows)
    errors.append(float((a - b).norm() / b.norm()))
    print(f"{which}: max relative logit error {max(errors):.2e}, greedy agreement {sum(agree) / len(agree):.3f}")
    assert max(errors) <= 2e-2
    assert sum(agree) / len(agree) >= 0.95


def test_fast_runner_in_fp32_matches_generate(tiny_model_dir):
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    model, _ = load_model(tiny_model_dir, "cuda:0", "float32")
    engine = Engine(model, runner="fast", max_num_seqs=16, max_kv_tokens=1 << 14)
    r = random.Random(11)
    prompts = [[1] + [r.randint(3, 1400) for _ in range(r.randint(1, 60))] for _ in range(8)]
    out = {i: [] for i in range(8)}
    rows = [StepRow(i, p, 0, 0) for i, p in enumerate(prompts)]
    for step in range(16):
        for row, token in zip(rows, engine.step(rows)):
            out[row.seq_id].append(token)
        rows = [StepRow(i, [out[i][-1]], len(prompts[i]) + step, step + 1) for i in range(8)]
    same = sum(out[i] == _generate(model, p, 16) for i, p in enumerate(prompts))
    assert same >= 7, same  # fp32 kernels on the GPU round differently from cuBLAS: ties may flip


@pytest.mark.parametrize("limit", ["prefill_tokens_per_step", "prefill_tokens_with_decode"])
def test_fast_runner_with_chunked_prefill_across_steps_matches_generate(tiny_model_dir, limit):
    """Prompts of up to 120 tokens at 32 prompt tokens a step (every step, or steps that also
    decode), beside decoding rows, on the fast runner (CUDA graphs for the mixed steps) in fp32."""
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.engine import Engine
    from qmigrate.worker.core import WorkerCore
    from test_chunked_prefill import Router
    model, _ = load_model(tiny_model_dir, "cuda:0", "float32")
    core = WorkerCore(Engine(model, runner="fast", max_num_seqs=16, max_kv_tokens=1 << 14, max_model_len=256,
                             **{limit: 32}))
    r = random.Random(12)
    prompts = {i: [1] + [r.randint(3, 1400) for _ in range(r.randint(20, 120))] for i in range(8)}
    router = Router(prompts, max_new_tokens=12)
    router.step(core, [0])
    first_at = router.run_all(core, max_leases=80)
    assert max(first_at.values()) > 4     # the prompts took several steps to fill
    same = sum(router.done[i] == _generate(model, p, 12) for i, p in prompts.items())
    assert same >= 7, same  # fp32 kernels on the GPU round differently from cuBLAS: ties may flip
    assert core.filling == {}


def test_steps_with_prompts_replay_token_graphs_with_the_eager_results(medium_model_dir):
    """Continuous batching's steps: decode rows with new prompts among them, a prefill alone,
    and a prompt longer than a chunk. With graphs they replay a token-bucket graph (padded
    tokens and rows); the logits match the eager forward's within bf16 rounding."""
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    model, _ = load_model(medium_model_dir, "cuda:0", "bfloat16")
    graphs = Engine(model, runner="fast", max_num_seqs=32, max_num_batched_tokens=2048, max_kv_tokens=1 << 16)
    eager = Engine(model, runner="fast", max_num_seqs=32, max_num_batched_tokens=2048, max_kv_tokens=1 << 16,
                   enforce_eager=True)
    assert graphs.runner.token_graphs and not eager.runner.token_graphs
    assert graphs.runner.token_buckets[-1] == 2048
    vocab = model.config.vocab_size
    r = random.Random(3)
    prompt = lambda n: [1] + [r.randint(3, vocab - 1) for _ in range(n - 1)]
    running = {i: prompt(r.randint(2, 90)) for i in range(20)}
    rows = [StepRow(i, ids, 0, 0) for i, ids in running.items()]
    errors, agree, replays = [], [], 0
    for step in range(12):
        a, b = _logits(graphs, rows), _logits(eager, rows)
        replays += graphs.runner.static_logits.data_ptr() == _last_logits_ptr(graphs, rows)
        errors.append(float((a - b).norm() / b.norm()))
        agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
        tokens = b.argmax(-1).tolist()
        for row, token in zip(rows, tokens):
            running[row.seq_id] = running[row.seq_id][:row.start + len(row.new_ids)] + [token]
        rows = [StepRow(sid, [ids[-1]], len(ids) - 1, 0) for sid, ids in running.items()]
        new = 100 + step
        running[new] = prompt([1, 7, 130, 700][step % 4])  # one token up to a chunk and more
        rows.append(StepRow(new, running[new], 0, 0))
        if len(rows) > 32:
            rows = rows[-32:]
    print(f"token graphs: max relative logit error {max(errors):.2e}, greedy agreement "
          f"{sum(agree) / len(agree):.3f}")
    assert replays == 12
    assert max(errors) <= 2e-2
    assert sum(agree) / len(agree) >= 0.97


def test_eager_steps_with_prompts_are_padded_and_match_the_unpadded_step(medium_model_dir):
    """A step with more tokens than the last token bucket runs eagerly, padded to a multiple
    of EAGER_TOKEN_STEP tokens and to max_batch logits rows (shapes the warm-up has run);
    its logits match the unpadded forward's within bf16 rounding."""
    from qmigrate.engine.batch import StepBatch
    from qmigrate.engine.runners.graph import EAGER_TOKEN_STEP
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    model, _ = load_model(medium_model_dir, "cuda:0", "bfloat16")
    kw = dict(runner="fast", max_num_seqs=32, max_num_batched_tokens=8192, max_kv_tokens=1 << 16)
    graphs, eager = Engine(model, **kw), Engine(model, enforce_eager=True, **kw)
    graphs.warm_up()
    assert graphs.runner.eager_sizes() == list(range(4096 + EAGER_TOKEN_STEP, 8192 + 1, EAGER_TOKEN_STEP))
    assert eager.runner.eager_sizes() == []
    vocab = model.config.vocab_size
    r = random.Random(5)
    rows = [StepRow(i, [1] + [r.randint(3, vocab - 1) for _ in range(r.randint(200, 300))], 0, 0)
            for i in range(21)]
    num_tokens = sum(len(row.new_ids) for row in rows)
    assert 4096 < num_tokens <= 8192 and num_tokens % EAGER_TOKEN_STEP
    a, b = _logits(graphs, rows), _logits(eager, rows)
    assert a.shape == b.shape == (len(rows), vocab)
    error = float((a - b).norm() / b.norm())
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"eager padded step of {num_tokens} tokens: relative logit error {error:.2e}, greedy agreement {agree:.3f}")
    assert error <= 2e-2 and agree >= 0.9
    # the padded forward's logits are the first rows of max_batch
    rows = [StepRow(100 + row.seq_id, row.new_ids, 0, 0) for row in rows]
    assert graphs.place(rows) == list(range(len(rows)))
    batch = StepBatch.build(graphs.pool, [row.seq_id for row in rows], [row.new_ids for row in rows], [0] * len(rows))
    with torch.inference_mode():
        logits = graphs.runner.forward(batch)
    assert logits.shape[0] == len(rows) and logits.untyped_storage().nbytes() == 32 * vocab * 4


def _last_logits_ptr(engine, rows) -> int:
    """Where a forward of these rows leaves its logits: the static buffer when a graph ran."""
    from qmigrate.engine.batch import StepBatch
    batch = StepBatch.build(engine.pool, [r.seq_id for r in rows], [r.new_ids for r in rows],
                            [r.start for r in rows])
    with torch.inference_mode():
        return engine.runner.forward(batch).data_ptr()

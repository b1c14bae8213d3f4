"""Every family of the fast runner (engine/models/) on the CPU in fp32, against transformers
on small random-weight configs: logits within 1e-4 relative of the transformers forward at
every position of a prompt and its continuation, and greedy output equal to generate() for
prompts in one batch, through a migration by KV transfer. Contexts run past the families'
sliding windows (8 positions) and through their soft-capping."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from transformers import GenerationConfig

from families import FAMILY_NAMES, WINDOW, build_family_model
from qmigrate.engine import models
from qmigrate.engine.batch import StepBatch
from qmigrate.engine.rows import StepRow
from qmigrate.engine.engine import Engine

NUM_NEW = 10


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param, build_family_model(request.param)


def fast_engine(model) -> Engine:
    engine = Engine(model, runner="fast", max_model_len=128, max_kv_tokens=1024, max_num_seqs=8, max_num_batched_tokens=256)
    assert engine.runner.name == "fast"
    return engine


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 256) for _ in range(k - 1)] for k in (2 * WINDOW + 5, WINDOW - 3, 2 * WINDOW)][:n]


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist()


def test_every_family_is_supported_with_a_reason_when_not(family):
    name, model = family
    assert models.unsupported(model, torch.device("cpu")) is None
    saved = model.config.model_type
    try:
        model.config.model_type = "gpt2"
        assert "gpt2" in models.unsupported(model, torch.device("cpu"))
    finally:
        model.config.model_type = saved


def test_an_unsupported_rope_type_is_named_and_fast_refuses_it():
    """Dynamic NTK scaling changes every frequency with the length: `auto` falls back with
    that reason, `fast` refuses the model with it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from families import SMALL
    cfg = LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    model = LlamaForCausalLM(cfg).eval()
    reason = models.unsupported(model, torch.device("cpu"))
    assert reason is not None and "'dynamic'" in reason
    with pytest.raises(ValueError, match="dynamic"):
        Engine(model, runner="fast", max_kv_tokens=256)
    assert Engine(model, runner="auto", max_kv_tokens=256).runner.name == "hf"


@torch.inference_mode()
def test_logits_equal_the_transformers_forward(family):
    """A prompt's prefill, then decode steps fed the next ids: each step's logits against the
    transformers forward of the whole sequence at the same position."""
    name, model = family
    expected = model(torch.tensor([seq := prompts(1, seed=1)[0]])).logits[0].float()
    err = logit_error(fast_engine(model), seq, expected)
    assert err <= 1e-4, f"{name}: relative logit error {err:.2e}"


def logit_error(engine: Engine, seq: list[int], expected: torch.Tensor) -> float:
    """A prompt's prefill, then decode steps fed the next ids, on `engine`: the largest
    relative error of their logits against `expected` (the forward of the whole sequence)."""
    prompt_len = len(seq) - 10
    got = []
    for start in [0] + list(range(prompt_len, len(seq) - 1)):
        new = seq[:prompt_len] if start == 0 else [seq[start]]
        engine.place([StepRow(1, new, start, 0)])
        batch = StepBatch.build(engine.pool, [1], [new], [start])
        got.append(engine.runner.forward(batch)[0])
        engine.pool.mark_written([1], [start + len(new)])
    got = torch.stack(got)
    want = expected[prompt_len - 1:len(seq) - 1]
    return ((got - want).abs().max() / want.abs().max()).item()


@torch.inference_mode()
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral"])
def test_the_transformers_runner_keeps_sliding_windows_and_soft_caps(name):
    """The transformers runner's own attention hook and head: a context past the window,
    Gemma's soft-capped scores and logits (the runner passes a causal mask of its own)."""
    model = build_family_model(name)
    expected = model(torch.tensor([seq := prompts(1, seed=1)[0]])).logits[0].float()  # before the hook
    engine = Engine(model, runner="hf", max_model_len=128, max_kv_tokens=1024)
    assert engine.runner.name == "hf"
    err = logit_error(engine, seq, expected)
    assert err <= 1e-4, f"{name}: relative logit error {err:.2e}"


def test_a_model_loads_with_an_attention_its_class_supports(tmp_path, tiny_model_dir):
    """Gemma 2 has no SDPA path in some transformers releases, where asking for one is an
    error; the loader asks for SDPA only where the class has it, and eager otherwise."""
    from transformers import Gemma2ForCausalLM, LlamaForCausalLM
    from qmigrate.hub.loading import load_model, load_structure
    for name, cls in (("gemma2", Gemma2ForCausalLM), ("llama3", LlamaForCausalLM)):
        build_family_model(name).save_pretrained(tmp_path / name)
        for f in tiny_model_dir.glob("tokenizer*"):
            shutil.copy(f, tmp_path / name)
        loaded, _ = load_model(tmp_path / name, "cpu")
        want = "sdpa" if cls._supports_sdpa else "eager"
        assert type(loaded) is cls and loaded.config._attn_implementation == want
        assert load_structure(tmp_path / name).config._attn_implementation == want


@torch.inference_mode()
def test_greedy_equals_generate_through_a_kv_transfer(family):
    """Three prompts batched on one engine; after a few tokens the longest moves to a second
    engine by KV transfer, and every output equals generate() for the prompt alone. The fast
    runner with its torch ops: each family's kernels are checked against transformers by the
    test above (the interpreter would take most of this test's time for nothing more)."""
    name, model = family
    ps = prompts(3, seed=2)
    refs = [reference_greedy(model, p, NUM_NEW) for p in ps]
    src, dst = fast_engine(model), fast_engine(model)
    for engine in (src, dst):
        engine.runner.use_kernels = False
    outs = [[] for _ in ps]
    rows = [StepRow(i, p, 0, 0) for i, p in enumerate(ps)]
    moved_at = 4
    for step in range(NUM_NEW):
        if step == moved_at:
            kv = src.export_kv(0)
            assert kv.shape[2] == len(ps[0]) + moved_at - 1
            src.release(0)
            assert dst.import_kv(0, kv.clone())
        on_dst = step >= moved_at
        here = [r for r in rows if not (on_dst and r.seq_id == 0)]
        tokens = src.step(here)
        if on_dst:
            tokens_dst = dst.step([r for r in rows if r.seq_id == 0])
        for r, t in zip(here, tokens):
            outs[r.seq_id].append(t)
        if on_dst:
            outs[0].append(tokens_dst[0])
        rows = [StepRow(r.seq_id, [outs[r.seq_id][-1]], r.start + len(r.new_ids), r.index + 1) for r in rows]
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out == ref, f"{name}, prompt {i}"

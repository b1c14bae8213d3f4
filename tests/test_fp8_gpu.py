"""FP8 on a GPU that has it (compute capability 9.0 for the matmuls, 8.9 for the KV cache):
the kernels against the CPU reference arithmetic, the fast runner's logits with FP8 weights
and KV against bf16, KV shipped between FP8 pools, the pool's size. Skipped elsewhere."""

from __future__ import annotations

import random

import pytest
import torch

from qmigrate.engine import fp8


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(_capability() < (9, 0), reason="needs a CUDA GPU with FP8 matmuls (sm90)")]


@pytest.fixture(autouse=True)
def _give_back_gpu_memory():
    yield
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def test_quantize_rows_kernel_matches_the_torch_arithmetic():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 4096, generator=g) * torch.logspace(-2, 2, 33)[:, None]).to(torch.bfloat16)
    x[5] = 0
    q, s = fp8.quantize_rows(x.cuda())
    q_ref, s_ref = fp8.quantize_rows(x)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    same = (q.cpu().view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.999, same   # a value on a rounding tie may go either way after a division


@pytest.mark.parametrize("m", [1, 7, 16, 40, 64, 300])
def test_scaled_matmul_matches_the_reference(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
    w = torch.randn(384, 512, generator=g) * 0.05
    bias = torch.randn(384, generator=g).to(torch.bfloat16)
    wq, ws = fp8.quantize_rows(w)
    if fp8.weight_only(m, 384, 512):   # the weight-read kernel: x as it is, the weight upcast as it is read
        want = (x.float() @ fp8.dequantize(wq, ws).t() + bias.float())
    else:                  # torch._scaled_mm: x quantized per token too, as the CPU reference does
        want = fp8.matmul(x, wq, ws, bias).float()
    got = fp8.matmul(x.cuda(), wq.cuda(), ws.cuda(), bias.cuda()).float().cpu()
    assert (got - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize("tiling", [(16, 512, 1), (32, 256, 2), (16, 128, 4), (64, 64, 3), (64, 128, 2, 4, 3, True),
                                    (128, 64, 1, 8, 3, True)])
def test_weight_read_kernel_tilings_match_the_weight_only_product(m, tiling):
    """Every tiling the tuner may pick, split-K included, on a k that no slice divides evenly
    (1040) and one that they do (2048), with and without a bias; the output poisoned first."""
    from qmigrate.engine.fp8_plan import W8
    g = torch.Generator().manual_seed(m * 7 + tiling[2])
    for n, k, with_bias in ((200, 1040, True), (96, 2048, False)):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g) * 0.05
        bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
        wq, ws = fp8.quantize_rows(w)
        want = x.float() @ fp8.dequantize(wq, ws).t() + (bias.float() if with_bias else 0)
        got = fp8.product(x.cuda(), wq.cuda(), ws.cuda(), bias.cuda() if with_bias else None, W8(*tiling))
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        got = got.float().cpu()
        assert not got.isnan().any()
        assert (got - want).norm() / want.norm() < 1e-2, (n, k)


def test_tuning_keeps_a_choice_per_bucket_and_times_every_candidate():
    from qmigrate.engine import fp8_plan, fp8_tune
    g = torch.Generator().manual_seed(3)
    weights = [fp8.quantize_rows((torch.randn(256, 1024, generator=g) * 0.05).cuda()) for _ in range(3)]
    report = []
    fp8_plan.forget()
    try:
        made = fp8_tune.tune({(256, 1024): weights}, torch.bfloat16, report)
        assert set(made) == {(b, 256, 1024) for b in fp8_plan.BUCKETS}
        assert len(report) == sum(len(c) for c in fp8_plan.CANDIDATES.values())
        assert all(us > 0 for *_, us in report)
        for b in fp8_plan.BUCKETS:
            assert fp8_plan.choice(b, 256, 1024) == made[(b, 256, 1024)]
    finally:
        fp8_plan.forget()


def test_the_pool_is_sized_after_the_checkpoint_tensors_fp8_replaced_are_freed(medium_model_dir, monkeypatch):
    """An engine handed its model frees the checkpoint's tensors its runner does not hold (the
    layers' bf16 weights, replaced by e4m3 ones and fused copies) before it sizes the pool:
    what the engine's start adds to the memory held until the pool's budget is taken is lower by
    at least those bytes, where an engine whose caller keeps the model leaves it whole. Each
    start is counted from the memory held just before it: what the first engine leaves behind
    once it is gone (caches of kernels and graphs, made after its pool was sized) is not the
    second's."""
    import gc
    from qmigrate.engine import startup
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.engine import Engine
    held_at_sizing, held_before = [], []
    budget = startup.gpu_kv_budget

    def spy(device, utilization, activation_bytes):
        torch.cuda.synchronize(device)
        held_at_sizing.append(torch.cuda.memory_allocated(device))
        return budget(device, utilization, activation_bytes)

    monkeypatch.setattr(startup, "gpu_kv_budget", spy)
    kw = dict(runner="fast", max_num_seqs=8, quantization="fp8", max_kv_tokens=1 << 12)
    kept, _ = load_model(medium_model_dir, "cuda:0", "bfloat16")
    layer_bytes = sum(p.numel() * p.element_size() for layer in kept.model.layers
                      for mod in (layer.self_attn, layer.mlp) for p in mod.parameters())
    held_before.append(torch.cuda.memory_allocated(0))
    a = Engine(kept, **kw)
    assert all(p.numel() > 0 for p in kept.parameters())    # a caller that keeps its model keeps it whole
    del a, kept
    gc.collect()
    torch.cuda.empty_cache()
    handed, _ = load_model(medium_model_dir, "cuda:0", "bfloat16")
    held_before.append(torch.cuda.memory_allocated(0))
    b = Engine(handed, own_model=True, **kw)
    assert all(p.numel() == 0 for layer in handed.model.layers for p in layer.self_attn.parameters())
    assert b.runner.model.layers[0].attn.qkv.weight.dtype == fp8.DTYPE
    assert len(held_at_sizing) == 2
    added = [at - before for at, before in zip(held_at_sizing, held_before)]
    assert added[0] - added[1] >= layer_bytes, (held_before, held_at_sizing, layer_bytes)


def _cache(num_blocks=40, block_size=16, heads=2, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, heads, dim, generator=g).to(fp8.DTYPE).cuda()
    v = torch.randn(num_blocks, block_size, heads, dim, generator=g).to(fp8.DTYPE).cuda()
    return k, v


def test_attention_kernels_read_an_e4m3_cache():
    from qmigrate.engine.kernels import paged_attention as attn
    k, v = _cache()
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([37, 100, 5, 160], dtype=torch.int32)
    tables = torch.stack([torch.randperm(39, generator=g)[:12] + 1 for _ in lens]).to(torch.int32)
    q = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16)
    qs = torch.arange(5, dtype=torch.int32)
    args = (lens.cuda(), tables.cuda(), 0.125)
    got = attn.decode_attention(q.cuda(), k, v, *args)
    want = attn.paged_attention_reference(q.cuda(), k, v, qs.cuda(), *args)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # prefill: 3 rows of several queries after a cached prefix
    nq = torch.tensor([6, 20, 1])
    qs = torch.cat([torch.zeros(1, dtype=torch.int64), nq.cumsum(0)]).to(torch.int32)
    lens3 = torch.tensor([40, 90, 7], dtype=torch.int32)
    q = torch.randn(int(nq.sum()), 8, 64, generator=g).to(torch.bfloat16).cuda()
    got = attn.prefill_attention(q, k, v, qs.cuda(), lens3.cuda(), tables[:3].cuda(), 0.125, int(nq.max()))
    want = attn.paged_attention_reference(q, k, v, qs.cuda(), lens3.cuda(), tables[:3].cuda(), 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def medium_model_dir(tmp_path_factory):
    from qmigrate.hub.builders import build_bench_model
    shape = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=1024, vocab_size=4096)
    return build_bench_model(tmp_path_factory.mktemp("models") / "medium", shape_overrides=shape)


def _logits(engine, rows):
    from qmigrate.engine.batch import StepBatch
    assert engine.place(rows) == list(range(len(rows)))
    batch = StepBatch.build(engine.pool, [r.seq_id for r in rows], [r.new_ids for r in rows],
                            [r.start for r in rows])
    with torch.inference_mode():
        logits = engine.runner.forward(batch).float().clone()
    engine.pool.mark_written([r.seq_id for r in rows], [r.start + len(r.new_ids) for r in rows])
    return logits


@pytest.mark.parametrize("setting", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"},
                                     {"quantization": "fp8", "kv_cache_dtype": "fp8"}])
def test_fp8_logits_follow_bf16_through_prefill_and_graph_decode(medium_model_dir, setting):
    """Prefills of mixed lengths, then 32 teacher-forced decode steps of 24 rows (CUDA graphs):
    FP8's logits stay near bf16's and pick the same token almost everywhere."""
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    model, _ = load_model(medium_model_dir, "cuda:0", "bfloat16")
    base = Engine(model, runner="fast", max_num_seqs=32, max_kv_tokens=1 << 15)
    other = Engine(model, runner="fast", max_num_seqs=32, max_kv_tokens=1 << 15, **setting)
    if "quantization" in setting:
        assert other.runner.model.layers[0].attn.qkv.weight.dtype == fp8.DTYPE
    if "kv_cache_dtype" in setting:
        assert other.pool.kv.dtype == fp8.DTYPE
    r = random.Random(7)
    prompts = [[1] + [r.randint(3, 4000) for _ in range(r.randint(1, 150))] for _ in range(24)]
    rows = [StepRow(i, p, 0, 0) for i, p in enumerate(prompts)]
    a, b = _logits(other, rows), _logits(base, rows)
    errors, agree = [float((a - b).norm() / b.norm())], [(a.argmax(-1) == b.argmax(-1)).float().mean().item()]
    tokens = b.argmax(-1).tolist()
    for step in range(32):
        rows = [StepRow(i, [tokens[i]], len(prompts[i]) + step, step + 1) for i in range(24)]
        a, b = _logits(other, rows), _logits(base, rows)
        errors.append(float((a - b).norm() / b.norm()))
        agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
        tokens = b.argmax(-1).tolist()
    assert max(errors) < 0.15, errors
    assert sum(agree) / len(agree) > 0.7, agree   # random weights: flat logits, many near-ties


def test_fp8_kv_shipped_between_workers_continues_as_if_it_stayed(medium_model_dir):
    """A sequence generates on one FP8-KV engine, its KV is exported, imported by another FP8-KV
    engine (as is) and by a bf16 one (converted): both continue; the FP8 one exactly as the
    first would have."""
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    model, _ = load_model(medium_model_dir, "cuda:0", "bfloat16")
    kw = dict(runner="fast", max_num_seqs=8, max_kv_tokens=1 << 13, enable_prefix_caching=False)
    a, b = Engine(model, kv_cache_dtype="fp8", **kw), Engine(model, kv_cache_dtype="fp8", **kw)
    c = Engine(model, **kw)
    prompt = [1] + list(range(5, 60))

    def run(engine, ids, start, n):
        out, row, pos = [], StepRow(0, ids[start:], start, 0), len(ids)
        for k in range(n):
            t = engine.step([row])[0]
            out.append(t)
            row, pos = StepRow(0, [t], pos, k + 1), pos + 1
        return out

    first = run(a, prompt, 0, 8)
    seq = prompt + first
    kv = a.export_kv(0, len(seq) - 1)
    assert kv.dtype == fp8.DTYPE
    stay = run(a, seq, len(seq) - 1, 8)
    assert b.import_kv(0, kv) and c.import_kv(0, kv)
    assert torch.equal(c.export_kv(0).float(), kv.float())      # converted exactly
    assert run(b, seq, len(seq) - 1, 8) == stay
    assert len(run(c, seq, len(seq) - 1, 8)) == 8

"""FP8 arithmetic (engine/fp8.py) against plain references on the CPU, the pool and attention
with an e4m3 cache, and the settings' refusal where there is no FP8. The GPU half is in
test_fp8_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qmigrate.engine import fp8
from qmigrate.engine.kv.pool import BlockPool, write_kv

E4M3 = torch.float8_e4m3fn


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value, from its 256 bit patterns (NaN: 0x7f and 0xff)."""
    vals = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    return vals[~vals.isnan()]


def _round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest e4m3 value (saturating), found by search rather than by a cast;
    a tie may go either way, so tests drop the values that sit on one."""
    grid = _e4m3_values().unique()
    idx = (x.float().clamp(-448, 448)[..., None] - grid).abs().argmin(-1)
    return grid[idx]


def test_saturating_cast_keeps_large_values_finite_and_nan_nan():
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.5, float("nan")])
    got = fp8.saturate(x).float()
    assert got[:4].tolist() == [448.0, -448.0, 448.0, 0.5]
    assert got[4].isnan()
    assert fp8.saturate(x, torch.bfloat16).dtype == torch.bfloat16   # another dtype: a plain cast


def test_quantize_rows_against_a_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0.0                                                   # an all-zero row
    q, scale = fp8.quantize_rows(x.to(torch.bfloat16))
    assert q.dtype == E4M3 and scale.shape == (7, 1) and scale.dtype == torch.float32
    xb = x.to(torch.bfloat16).float()
    want_scale = (xb.abs().amax(1, keepdim=True) / 448).clamp(min=fp8.MIN_SCALE)
    torch.testing.assert_close(scale, want_scale)
    scaled = xb / want_scale
    want = _round_to_e4m3(scaled)
    off_tie = (_round_to_e4m3(scaled * (1 + 1e-6)) == _round_to_e4m3(scaled * (1 - 1e-6)))
    assert off_tie.float().mean() > 0.95
    assert torch.equal(q.float()[off_tie], want[off_tie])
    assert q.float().abs().amax(1)[torch.arange(7) != 3].eq(448).all()   # each row's largest value maps to 448
    assert q[3].float().eq(0).all()
    # back within e4m3's precision: 3 mantissa bits, half an ulp relative, past the subnormals
    back = fp8.dequantize(q, scale)
    normal = scaled.abs() >= 2 ** -6
    assert ((back - xb).abs() <= xb.abs() / 16 + 1e-30)[normal].all()


def test_matmul_reference_is_the_product_of_the_quantized_operands():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=g)
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    wq, ws = fp8.quantize_rows(w)
    got = fp8.matmul(x, wq, ws, bias)
    xq, xs = fp8.quantize_rows(x)
    want = (xq.float() * xs) @ (wq.float() * ws).t()
    torch.testing.assert_close(got.float(), (want.to(torch.bfloat16) + bias).float(), rtol=1e-2, atol=1e-2)
    # and near the full-precision product (FP8's error, a few percent)
    exact = F.linear(x.float(), w, bias.float())
    assert (got.float() - exact).norm() / exact.norm() < 0.06


def test_linear_quantizes_only_shapes_the_fp8_matmul_takes():
    from qmigrate.engine.layers.linear import Linear
    g = torch.Generator().manual_seed(2)
    lin = Linear(torch.randn(32, 64, generator=g).to(torch.bfloat16), None, "column")
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    before = lin(x)
    assert lin.quantize_fp8() and lin.weight.dtype == E4M3 and lin.scale.shape == (32, 1)
    after = lin(x)
    assert after.dtype == torch.bfloat16 and after.shape == before.shape
    assert (after.float() - before.float()).norm() / before.float().norm() < 0.06
    odd = Linear(torch.randn(30, 64, generator=g), None, "column")
    assert not odd.quantize_fp8() and odd.weight.dtype == torch.float32 and odd.scale is None


def test_quantize_model_leaves_embeddings_norms_and_head_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from qmigrate.engine import models
    from qmigrate.engine.models.base import quantize_fp8
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model = models.build(hf)
    done, left = quantize_fp8(model)
    assert (done, left) == (4 * len(model.layers), 0)
    for layer in model.layers:
        for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down):
            assert lin.weight.dtype == E4M3 and lin.scale is not None
        assert layer.input_norm.weight.dtype == torch.bfloat16
    assert model.embed.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.scale is None


def _pool(dtype, blocks=8, block_size=4):
    return BlockPool(2, 2, 16, blocks, block_size, dtype, torch.device("cpu"), prefix_cache=False)


def test_fp8_pool_stores_saturated_e4m3_and_ships_it_as_is():
    pool = _pool(E4M3)
    pool.grow(1, 6)
    pool.mark_written([1], [6])
    g = torch.Generator().manual_seed(3)
    k = torch.randn(6, 2, 16, generator=g).to(torch.bfloat16) * 4
    v = torch.randn(6, 2, 16, generator=g).to(torch.bfloat16)
    k[0, 0, 0] = 1000.0
    slots = torch.from_numpy(pool.slots(1, 0, 6))
    for layer in range(2):
        write_kv(pool.kv[layer, 0], pool.kv[layer, 1], slots, k, v)
    shipped = pool.export(1)
    assert shipped.dtype == E4M3 and shipped.shape == (2, 2, 6, 2, 16)
    assert shipped[0, 0, 0, 0, 0].float() == 448.0
    assert torch.equal(shipped[1, 0].float(), fp8.saturate(k).float())
    assert torch.equal(shipped[1, 1].float(), fp8.saturate(v).float())
    # a receiver of the same dtype takes the bytes; one in bf16 converts them exactly
    same, wide = _pool(E4M3), _pool(torch.bfloat16)
    assert same.load(7, shipped, set()) and wide.load(7, shipped, set())
    assert torch.equal(same.export(7).view(torch.uint8), shipped.view(torch.uint8))
    assert torch.equal(wide.export(7).float(), shipped.float())
    # and bf16 shipped into an e4m3 pool is cast (saturating)
    back = _pool(E4M3)
    big = wide.export(7) * 8
    assert back.load(9, big, set())
    assert torch.equal(back.export(9).float(), fp8.saturate(big).float())


def test_fp8_pool_copies_a_shared_block_by_its_bytes():
    from qmigrate.engine.rows import StepRow
    pool = BlockPool(1, 1, 16, 6, 4, E4M3, torch.device("cpu"), prefix_cache=True)
    ids = list(range(10, 19))
    pool.admit(1, ids)
    pool.grow(1, 9)
    pool.kv.view(torch.uint8)[:, :, pool.blocks[1]] = 0x38   # 1.0 in e4m3
    pool.mark_written([1], [9], rows=[StepRow(1, ids, 0, 0)])
    pool.release(1)
    start = pool.admit(2, ids[:6] + [99, 98, 97])
    assert start == 4
    pool.grow(2, 6)
    assert pool.truncate(2, 2)                                 # cuts into the cached block: a copy
    assert pool.kv[0, 0, pool.blocks[2][0]].float().eq(1.0).all()
    pool.check()


def test_reference_attention_reads_an_e4m3_cache_as_its_values():
    from qmigrate.engine.kernels.paged_attention import paged_attention_reference
    g = torch.Generator().manual_seed(4)
    k = (torch.randn(5, 4, 2, 16, generator=g)).to(E4M3)
    v = (torch.randn(5, 4, 2, 16, generator=g)).to(E4M3)
    q = torch.randn(3, 4, 16, generator=g).to(torch.bfloat16)
    args = (torch.tensor([0, 1, 3]), torch.tensor([6, 9]), torch.tensor([[1, 2, 0], [3, 4, 1]]), 0.25)
    got = paged_attention_reference(q, k, v, *args)
    want = paged_attention_reference(q, k.to(torch.bfloat16), v.to(torch.bfloat16), *args)
    assert torch.equal(got, want)


@pytest.mark.parametrize("setting", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}])
def test_engine_refuses_fp8_on_the_cpu_in_one_line(tiny_model_dir, setting):
    from transformers import AutoModelForCausalLM
    from qmigrate.engine.engine import Engine
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError) as err:
        Engine(model, **setting)
    msg = str(err.value)
    assert "needs a CUDA GPU" in msg and "cpu" in msg and "\n" not in msg
    assert next(iter(setting)) in msg


def test_unsupported_names_an_old_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    why = fp8.unsupported(torch.device("cuda:0"), "quantization fp8", (9, 0))
    assert why == "quantization fp8 needs compute capability 9.0 or later (FP8); NVIDIA A100 has 8.0"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.unsupported(torch.device("cuda:0"), "quantization fp8", (9, 0)) is None


def test_settings_are_checked_and_a_cpu_worker_refuses_fp8():
    from qmigrate.config import ConfigError, parse_topology
    from qmigrate.engine.config import EngineConfig
    with pytest.raises(Exception, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(Exception, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp16")
    data = {"transport": "ipc", "model": {"path": "m"}, "nodes": [{"name": "local"}],
            "router": {"node": "local"}, "ingest": {"node": "local"}, "detokenizer": {"node": "local"},
            "workers": [{"name": "w1", "node": "local", "device": "cpu"}]}
    data["workers"][0]["kv_cache_dtype"] = "fp8"
    with pytest.raises(ConfigError, match=r"workers\[0\]\.kv_cache_dtype.*needs a CUDA GPU"):
        parse_topology(data)
    data["workers"][0]["device"] = "cuda:0"
    assert parse_topology(data).workers[0].kv_cache_dtype == "fp8"


def test_router_prices_an_fp8_worker_shipment_at_one_byte_a_value():
    from qmigrate.hub.model_facts import DTYPE_BYTES
    assert DTYPE_BYTES["float8_e4m3fn"] == 1
    from qmigrate.worker.loop import KV_DTYPES
    assert KV_DTYPES["float8_e4m3fn"] is E4M3


def test_fp8_kv_pool_holds_twice_the_tokens():
    """The same bytes of pool hold twice the tokens in e4m3 as in bf16 (startup's sizing rule)."""
    from types import SimpleNamespace
    from qmigrate.engine import startup
    from qmigrate.engine.config import EngineConfig
    from qmigrate.hub.shape import ModelShape
    cfg = EngineConfig(max_kv_tokens=0)
    shape = SimpleNamespace(num_kv_heads=8, num_layers=32, head_dim=128)
    sizes = []
    for itemsize in (2, 1):
        per_token = ModelShape.kv_bytes_per_token(SimpleNamespace(**vars(shape)), itemsize)
        engine = SimpleNamespace(config=cfg, kv_bytes_per_token=per_token, pool_kv_heads=8, shape=shape,
                                 device=torch.device("cpu"), max_len=1024)
        sizes.append(startup.num_blocks_here(engine) - 1)
    assert sizes[1] == 2 * sizes[0]


def test_weight_read_kernel_indexing_under_the_interpreter():
    """The few-rows kernel's tiles, masks, split-K partials and scale/bias epilogue
    (kernels/fp8_gemm.py), in fp32: numpy, which runs triton's interpreter, has no bf16 or
    e4m3 (tests/test_fp8_gpu.py runs it on e4m3 weights on a GPU)."""
    from qmigrate.engine.kernels import paged_attention as pa
    if not (torch.cuda.is_available() or (pa.triton is not None and pa.is_interpreted())):
        pytest.skip("no CUDA, and triton was imported before TRITON_INTERPRET")
    from qmigrate.engine.kernels.fp8_gemm import w8_matmul
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    for m, n, k, tiling in ((1, 96, 576, (32, 128, 1)), (1, 70, 600, (16, 128, 3)), (5, 70, 600, (32, 128, 1)),
                            (5, 96, 512, (32, 64, 4)), (17, 40, 256, (16, 64, 2)), (5, 70, 600, (32, 128, 2, True)),
                            (33, 200, 512, (64, 128, 1, True)), (1, 96, 576, (32, 128, 1, True, True)),
                            (1, 70, 600, (16, 128, 3, True, True)), (5, 70, 600, (32, 128, 2, False, True))):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
        scale, bias = torch.rand(n, 1, generator=g) + 0.5, torch.randn(n, generator=g)
        x, w, scale, bias = (t.to(device) for t in (x, w, scale, bias))
        for b in (bias, None):
            block_n, block_k, split_k, swap, f16 = (*tiling, False, False)[:5]
            out = w8_matmul(x, w, scale, b, block_n, block_k, split_k, num_warps=4, num_stages=2, swap=swap, f16=f16)
            want = x @ (w * scale).t() + (0 if b is None else b)
            assert out.shape == (m, n)
            # f16: x and w rounded to fp16's 11 bits before the product
            assert (out - want).norm() / want.norm() < (2e-3 if f16 else 1e-4), (m, n, k, tiling)


def test_quality_agreement_counts_exact_answers_and_the_agreeing_prefix():
    from qmigrate.bench.quality import agreement
    got = agreement([[1, 2, 3, 4], [5, 6], [7, 8, 9, 9]], [[1, 2, 3, 4], [5, 0], [1, 8, 9, 9]])
    assert got == {"exact": 1, "prompts": 3, "mean_prefix": (1 + 0.5 + 0) / 3}


def test_quality_perplexity_is_the_models_own(tiny_model_dir):
    """The teacher-forced perplexity through the engine's decode steps equals the one computed
    from the transformers model's logits over the whole text (fp32, the CPU)."""
    from transformers import AutoModelForCausalLM
    from qmigrate.bench.quality import perplexity
    from qmigrate.engine.engine import Engine
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = [1] + [(7 * i) % 1400 + 3 for i in range(39)]
    engine = Engine(model, max_num_seqs=4, max_kv_tokens=1 << 10)
    got = perplexity(engine, ids, rows=2)
    with torch.no_grad():
        nll = []
        for row in (ids[:20], ids[20:]):
            logits = model(torch.tensor([row])).logits[0, :-1].float()
            nll.append(-torch.log_softmax(logits, -1).gather(1, torch.tensor(row[1:])[:, None]).squeeze(1))
    want = torch.cat(nll).mean().exp().item()
    assert got == pytest.approx(want, rel=1e-4)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1   # its rows were released


def test_bench_settings_combine_and_bad_values_name_the_flag():
    from qmigrate.bench.quality import parse_variants
    from qmigrate.bench.step import setting_variants
    assert setting_variants("none,fp8", "auto,fp8") == [
        {}, {"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}, {"quantization": "fp8", "kv_cache_dtype": "fp8"}]
    with pytest.raises(ValueError, match="--kv-cache-dtype takes auto or fp8"):
        setting_variants("fp8", "fp16")
    assert parse_variants("quantization=fp8;kv_cache_dtype=fp8") == [{"quantization": "fp8"},
                                                                     {"kv_cache_dtype": "fp8"}]
    with pytest.raises(ValueError, match="--variants"):
        parse_variants("fp8")


def test_fp8_plan_buckets_and_untuned_tilings_fill_the_multiprocessors():
    from qmigrate.engine import fp8_plan
    assert [fp8_plan.bucket(m) for m in (1, 2, 16, 17, 64, 65)] == [1, 16, 16, 64, 64, None]
    fp8_plan.forget()
    assert fp8_plan.choice(65, 4096, 4096) is fp8_plan.SCALED_MM
    assert fp8_plan.choice(40, 4096, 4096) is fp8_plan.SCALED_MM      # past 16 rows untuned: _scaled_mm
    for m in (1, 8):
        for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (576, 1536)):
            t = fp8_plan.choice(m, n, k)
            programs = -(-n // t.block_n) * t.split_k
            assert programs >= 2 * 132 or t.split_k == 4 or k < 4 * t.split_k * t.block_k, (m, n, k, t)
            assert t.split_k * t.block_k <= k
    assert fp8_plan.choice(1, 4096, 4096).split_k > 1                 # 4096 columns alone: too few programs
    assert fp8_plan.choice(1, 28672, 4096).split_k == 1


def test_a_tuned_choice_applies_to_its_bucket_only():
    from qmigrate.engine import fp8_plan
    fp8_plan.forget()
    try:
        fp8_plan._chosen[(16, 4096, 4096)] = fp8_plan.W8(64, 128, 1)
        fp8_plan._chosen[(64, 4096, 4096)] = fp8_plan.SCALED_MM
        assert fp8_plan.choice(9, 4096, 4096) == fp8_plan.W8(64, 128, 1)
        assert fp8_plan.choice(1, 4096, 4096) == fp8_plan.default(1, 4096, 4096)
        assert fp8_plan.choice(30, 4096, 4096) is fp8_plan.SCALED_MM
        assert fp8_plan.choice(9, 4096, 2048) == fp8_plan.default(9, 4096, 2048)   # another shape
    finally:
        fp8_plan.forget()


def test_release_unheld_empties_only_what_the_built_model_does_not_hold():
    from qmigrate.engine.layers.linear import Linear
    from qmigrate.engine.models.base import held_storages, release_unheld
    src = torch.nn.ModuleDict({"q": torch.nn.Linear(8, 16, bias=False), "k": torch.nn.Linear(8, 16, bias=False),
                               "o": torch.nn.Linear(16, 8), "norm": torch.nn.LayerNorm(8)})
    fused = Linear.of(src["q"], src["k"], parallel="column")          # a copy: q and k are no longer needed
    o = Linear.of(src["o"], parallel="row")                           # the same tensors as the source's
    built = {"layers": [fused, o], "norm": src["norm"].weight.detach()}
    assert held_storages(built)[o.weight.untyped_storage().data_ptr()] == 16 * 8 * 4
    released = release_unheld(src, built)
    # q and k (fused into a copy), o's bias (Linear.of copies biases) and the norm's unused bias
    assert released == 2 * 16 * 8 * 4 + 8 * 4 + 8 * 4
    assert src["q"].weight.numel() == 0 and src["k"].weight.numel() == 0 and src["norm"].bias.numel() == 0
    assert src["o"].bias.numel() == 0
    assert src["o"].weight.shape == (8, 16) and src["norm"].weight.shape == (8,)
    assert fused.weight.shape == (32, 8) and torch.isfinite(fused.weight).all()

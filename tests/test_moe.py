"""The grouped expert layer: routing blocks, the Triton grouped GEMM (under triton's
interpreter on the CPU) against the per-expert reference, and the active-weight floor."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # must precede the first import of triton (and of our kernels) in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qmigrate.engine.layers import moe as M  # noqa: E402
from qmigrate.engine.kernels import paged_attention as pa  # noqa: E402

KERNELS = M.grouped_gemm_kernel is not None and (torch.cuda.is_available() or pa.is_interpreted())
needs_kernels = pytest.mark.skipif(not KERNELS, reason="no CUDA, and triton was imported before TRITON_INTERPRET")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_route_blocks_sorts_by_expert_and_pads_each_run():
    experts = torch.tensor([3, 0, 3, 1, 3, 0, 5])
    sorted_ids, tile_expert = M.route_blocks(experts, num_experts=6, block_m=2)
    pad = len(experts)
    assert len(sorted_ids) == len(tile_expert) * 2 and len(tile_expert) == -(-7 // 2) + 6
    tiles = sorted_ids.view(-1, 2).tolist()
    real = [(e, t) for e, t in zip(tile_expert.tolist(), tiles) if e >= 0]
    assert real == [(0, [1, 5]), (1, [3, pad]), (3, [0, 2]), (3, [4, pad]), (5, [6, pad])]
    assert all(e == -1 for e in tile_expert.tolist()[len(real):])


def _moe(num_experts=6, hidden=32, inter=24, top_k=2, shared=False, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    r = lambda *s, std=0.3: (torch.randn(*s, generator=gen) * std).to(dtype=dtype, device=device)  # noqa: E731
    sh = None
    if shared:
        sh = M.GatedMLP(M.Linear(r(2 * inter, hidden), None, "column", (inter, inter)),
                        M.Linear(r(hidden, inter), None, "row"))
    return M.MoE(M.Linear(r(num_experts, hidden, std=1.0), None, "replicated"), r(num_experts, 2 * inter, hidden),
                 r(num_experts, hidden, inter), top_k, True, True, "silu", sh,
                 M.Linear(r(1, hidden), None, "replicated") if shared else None)


@needs_kernels
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_grouped_gemm_equals_the_per_expert_reference(num_tokens):
    moe = _moe(device=DEVICE, shared=True)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE)
    weights, experts = moe.route(x)
    got = moe._grouped(x, weights, experts)
    want = moe._per_expert(x, weights, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert moe(x).shape == x.shape


def test_active_weight_bytes_count_the_experts_a_batch_hits(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from families import build_family_model
    from qmigrate.engine import models
    from qmigrate.engine.models.moe import active_weight_bytes
    model = models.build(build_family_model("mixtral"))
    one, total = active_weight_bytes(model, 1)
    many, total_again = active_weight_bytes(model, 512)
    experts = sum(layer.mlp.gate_up.numel() + layer.mlp.down.numel() for layer in model.layers) * 4
    assert total == total_again and one < many
    # one row reads 2 of 8 experts per layer; 512 rows read practically all of them
    assert many - one == pytest.approx(experts * 6 / 8 + (512 - 1) * model.embed.shape[1] * 4, rel=1e-3)


def test_bench_moe_model_runs_on_the_fast_runner_and_its_floor_counts_active_experts(tmp_path):
    from qmigrate.bench.step import _step_bytes
    from qmigrate.hub.builders import build_bench_moe_model
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    small = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, vocab_size=1500)
    model, _ = load_model(build_bench_moe_model(tmp_path / "moe", dtype="float32", shape_overrides=small), "cpu")
    assert model.config.model_type == "mixtral"
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = Engine(model, runner="fast", max_kv_tokens=512, max_num_seqs=4)
    assert engine.runner.name == "fast"
    assert len(engine.step([StepRow(1, [1, 5, 9, 12], 0, 0)])) == 1
    floor = _step_bytes(engine, weight_bytes)
    assert floor(1) < floor(8) < weight_bytes


@pytest.mark.skipif(torch.cuda.is_available() or not KERNELS, reason="the interpreter's run of the GPU path")
@pytest.mark.parametrize("name", ["qwen2_moe", "gemma2"])
def test_families_through_the_kernels_under_the_interpreter(name, monkeypatch):
    """The path a GPU runs (the grouped GEMM; attention kernels with windows and soft-capping)
    against transformers in fp32, under triton's interpreter."""
    sys.path.insert(0, os.path.dirname(__file__))
    from families import build_family_model
    from test_families import test_logits_equal_the_transformers_forward
    calls = []
    for fn in ("prefill_attention", "decode_attention"):
        real = getattr(pa, fn)
        monkeypatch.setattr(pa, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
    real_gemm = M.grouped_gemm
    monkeypatch.setattr(M, "grouped_gemm", lambda *a, **k: calls.append("grouped") or real_gemm(*a, **k))
    test_logits_equal_the_transformers_forward((name, build_family_model(name)))
    assert {"prefill_attention", "decode_attention"} <= set(calls)
    assert ("grouped" in calls) == (name == "qwen2_moe")

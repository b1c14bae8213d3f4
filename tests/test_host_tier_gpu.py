"""The host KV tier on a GPU pool: asynchronous copies to pinned memory and back; they skip
cleanly on a machine without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_blocks_go_to_pinned_memory_and_come_back_bit_for_bit():
    from qmigrate.engine.kv.host_tier import HostTier, export_by_keys
    from qmigrate.engine.kv.pool import BlockPool
    pool = BlockPool(2, 2, 8, 12, 4, torch.bfloat16, torch.device("cuda:0"))
    pool.kv.copy_(torch.randn(pool.kv.shape, device="cuda:0"))
    want = pool.kv.clone()
    tier = HostTier(pool.kv, 1 << 20)
    pool.attach_tier(tier)
    assert tier.pin and tier.stream is not None
    tier.save(pool.kv, [3, 4, 7], [30, 40, 70])
    assert tier.chunks[0].is_pinned()
    pool.kv[:, :, 3:8] = 0          # the blocks are reused at once: queued after the copy out
    tier.restore(pool.kv, [9, 10, 11], [30, 40, 70])
    torch.cuda.synchronize()
    for got, was in ((9, 3), (10, 4), (11, 7)):
        assert torch.equal(pool.kv[:, :, got], want[:, :, was])
    kv, copied = export_by_keys(pool, [30, 40, 50])   # held in the tier (50 is not: the chain ends)
    copied.synchronize()
    assert kv.shape == (2, 2, 8, 2, 8) and not kv.is_cuda
    assert torch.equal(kv, torch.cat([want[:, :, 3], want[:, :, 4]], dim=2).cpu())
    tier.check()


def test_engine_with_a_host_tier_on_cuda_matches_generate_in_fp32(tiny_model_dir):
    from qmigrate.engine.engine import Engine
    from qmigrate.engine.rows import StepRow
    from qmigrate.hub.loading import load_model
    model, _ = load_model(tiny_model_dir, "cuda:0", "float32")
    engine = Engine(model, runner="hf", max_model_len=128, max_kv_tokens=128, kv_offloading_size=0.01)
    assert engine.pool.tier is not None and engine.pool.tier.on_device
    r = random.Random(8)
    convs = [[1] + [r.randint(3, 1400) for _ in range(98)] for _ in range(3)]

    def greedy(prompt, n):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt], device="cuda:0"), max_new_tokens=n, do_sample=False)
        return out[0, len(prompt):].tolist()

    def generate(sid, prompt, n):
        pending = engine.launch([StepRow(sid, list(prompt), 0, 0)])
        out = [engine.collect(pending)[0]]
        while len(out) < n:
            out.append(engine.step([StepRow(sid, [out[-1]], len(prompt) + len(out) - 1, len(out))])[0])
        engine.release(sid)
        return out, pending.cached.get(sid, 0)

    for sid, prompt in enumerate(convs + convs, start=1):   # the second round finds them in the tier
        out, cached = generate(sid, prompt, 6)
        assert out == greedy(prompt, 6), sid
    assert engine.pool.tier.num_hits > 0
    engine.pool.check()


def test_a_gpu_engine_has_a_pinned_tier_by_default(tiny_model_dir):
    from qmigrate.engine.engine import Engine
    from qmigrate.engine.kv.host_tier import available_ram
    from qmigrate.hub.loading import load_model
    model, _ = load_model(tiny_model_dir, "cuda:0", "float32")
    ram = available_ram()
    engine = Engine(model, runner="hf", max_model_len=128, max_kv_tokens=128)
    tier = engine.pool.tier
    assert tier is not None and tier.pin and tier.chunks[0].is_pinned()
    held = tier.capacity * tier.block_bytes
    assert 0 < held <= min(ram / 4 / torch.cuda.device_count(), 64 << 30)
    assert "allocated while idle" in engine.describe()
    first = tier.allocated()
    assert first < tier.capacity and engine.grow_tier() and tier.allocated() > first
    assert tier.chunks[-1].is_pinned()
    tier.check()
    assert Engine(model, runner="hf", max_model_len=128, max_kv_tokens=128, kv_offloading_size=0).pool.tier is None

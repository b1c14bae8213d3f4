"""What each rank of the in-process tensor-parallel tests runs (a spawned process per rank).

Rank 0 runs every case on a tensor-parallel engine and on a one-rank engine of the same
model, and checks them against each other and against transformers' generate(); the other
ranks follow it. Rank 0 writes what it found to `out` as JSON.
"""

from __future__ import annotations

import copy
import ctypes
import faulthandler
import importlib
import json
import os
import signal
import traceback

import torch

import families
from qmigrate.engine.parallel import lockstep
from qmigrate.engine.parallel.sharding import TensorParallel
from qmigrate.engine.rows import StepRow
from qmigrate.engine.engine import Engine

NUM_NEW = 6
MORE = 4     # tokens decoded after a KV move
FAMILIES = {
    # head_dim 16 (not hidden / heads = 8): the GPU kernels' narrowest tile, so the 2-GPU test runs it too
    "llama": dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                  attention_bias=True, mlp_bias=True),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                    sliding_window=None),
    "qwen2": dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1),
    "qwen3": dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
# the other fast-runner families, as tests/families.py builds them (4 heads, 2 KV heads: split
# on 2 ranks, replicated on 4): soft-capping and windows, fused q/k/v and gate/up, experts
SHARED_FAMILIES = ("gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
GPU_CASES = ("tiny", "llama", "mixtral")


def random_config(family: str):
    from transformers import AutoConfig
    return AutoConfig.for_model(family, vocab_size=101, num_hidden_layers=2, max_position_embeddings=128,
                                tie_word_embeddings=False, **FAMILIES[family])


def random_model(family: str):
    """A random model of the family, the same on every rank (seeded)."""
    from transformers import AutoModelForCausalLM
    cfg = random_config(family)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.1)
            if p.dim() == 1 and p.shape[0] == cfg.hidden_size:
                p.add_(1.0)   # norms near one
    return model


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 9)]


def greedy(engine: Engine, prompts, num_new: int, first_id: int = 0, starts=None) -> list[list[int]]:
    """Greedy tokens of each prompt: a prefill (from `starts` when KV is already there), then
    decode steps whose input is fed on the device from the step before."""
    starts = list(starts or [0] * len(prompts))
    rows = [StepRow(first_id + i, list(p[s:]), s, 0) for i, (p, s) in enumerate(zip(prompts, starts))]
    pending, out = engine.launch(rows), [[] for _ in prompts]
    pos = [len(p) for p in prompts]
    for step in range(1, num_new):
        rows = [StepRow(first_id + i, [], pos[i] + step - 1, step) for i in range(len(prompts))]
        nxt = engine.launch(rows, after=pending)
        for o, t in zip(out, engine.collect(pending)):
            o.append(t)
        pending = nxt
    for o, t in zip(out, engine.collect(pending)):
        o.append(t)
    return out


def generate(model, prompt, n):
    from transformers import GenerationConfig
    ids = torch.tensor([prompt])
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(prompt):].tolist()


def recorded(engine: Engine) -> list[torch.Tensor]:
    logits, forward = [], engine.runner.forward

    def spy(batch, feed=None):
        out = forward(batch) if feed is None else forward(batch, feed=feed)
        logits.append(out.clone())
        return out
    engine.runner.forward = spy
    return logits


def check_case(model, tp: TensorParallel) -> dict:
    kw = dict(runner="fast", max_model_len=64, max_kv_tokens=512)
    sharded = Engine(model, tp=tp, **kw)
    if not tp.is_leader:
        lockstep.follow(sharded)
        return {}
    one = Engine(model if tp.device.type == "cpu" else copy.deepcopy(model).to(tp.device), **kw)
    if tp.device.type == "cpu":
        # the one-rank engine's attention on the torch reference path: the sharded kernels
        # are held to an independent implementation (the one-rank kernels are held to
        # transformers in test_families), at a fraction of the interpreter's time
        getattr(one.runner, "inner", one.runner).use_kernels = False
    prompts = prompts_for(model.config.vocab_size)
    got_logits, ref_logits = recorded(sharded), recorded(one)
    got, ref = greedy(sharded, prompts, NUM_NEW), greedy(one, prompts, NUM_NEW)
    expected = [generate(model, p, NUM_NEW + MORE) for p in prompts]
    diff = max(float((a - b).abs().max()) for a, b in zip(got_logits, ref_logits))
    steps = len(got_logits)
    scale = max(float(b.abs().max()) for b in ref_logits)
    # a sequence moves both ways, ranks -> one and one -> ranks, its KV transferred
    p = prompts[1]
    n = len(p) + NUM_NEW - 1          # the last sampled token is not in the KV yet
    kv = sharded.export_kv(1)
    one_kv = one.export_kv(1)
    moved = {"kv_diff": float((kv - one_kv).abs().max()), "kv_scale": float(one_kv.abs().max())}
    sharded.release(1)
    one.release(1)
    cont = p + got[1]
    assert one.import_kv(50, kv)
    moved["to_one"] = greedy(one, [cont], MORE, first_id=50, starts=[n])[0]
    assert sharded.import_kv(60, one_kv)
    moved["to_ranks"] = greedy(sharded, [cont], MORE, first_id=60, starts=[n])[0]
    # or by recompute: the sequence so far prefilled again, on either side (the token that
    # prefill samples; the decode steps after it are any decode's)
    moved["recomputed_to_one"] = greedy(one, [cont], 1, first_id=70)[0]
    moved["recomputed_to_ranks"] = greedy(sharded, [cont], 1, first_id=80)[0]
    sharded.runner.stop()
    return {"got": got, "ref": ref, "expected": [e[:NUM_NEW] for e in expected], "max_logit_diff": diff, "logit_scale": scale,
            "steps": steps, "moved": moved, "moved_expected": expected[1][NUM_NEW:],
            "kv_shape": list(kv.shape), "kernels": getattr(sharded.runner, "inner", sharded.runner).use_kernels}


# transformers' modules of every case's model (families.py's and the ones above)
MODEL_MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")


def run_world(world: int, init_method: str, tiny_dir: str, out: str, device: str = "cpu",
              weightless_dir: str | None = None) -> None:
    """Every rank of a world (run_rank), each forked from this process once it has imported
    what a rank needs: one interpreter's imports (torch, transformers' model code) instead of
    one per rank. A rank dies with this process."""
    torch.set_num_threads(1)   # before any op: a forked child must not inherit a thread pool
    import transformers  # noqa: F401
    from qmigrate.hub import loading  # noqa: F401
    for name in MODEL_MODULES:
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    launcher = os.getpid()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
                if os.getppid() == launcher:
                    run_rank(rank, world, init_method, tiny_dir, out, device, weightless_dir)
                    code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def run_rank(rank: int, world: int, init_method: str, tiny_dir: str, out: str, device: str = "cpu",
             weightless_dir: str | None = None) -> None:
    """With `weightless_dir` (the tiny model's config and tokenizer, no weights) the ranks
    other than 0 build every model without weights, as a tensor-parallel worker's do, and
    may not load a checkpoint: their shards must all come from rank 0. Then the ranks build
    models that differ, and each says what it reported ("mismatch")."""
    torch.set_num_threads(1)
    result = {}
    if device == "cuda":  # a rank that stops moving shows where, on stderr (pytest -s)
        faulthandler.dump_traceback_later(90, repeat=True)
    try:
        tp = TensorParallel.init(rank, world, init_method, f"cuda:{rank}" if device == "cuda" else device)
        from qmigrate.hub.loading import load_model
        cases = {"tiny": lambda: load_model(tiny_dir, "cpu")[0]}
        cases.update({f: (lambda f=f: random_model(f)) for f in FAMILIES})
        cases.update({f: (lambda f=f: families.build_family_model(f, seed=5)) for f in SHARED_FAMILIES})
        if device == "cuda":  # each case compiles and captures its own kernels: a dense and a MoE family
            cases = {name: cases[name] for name in GPU_CASES}
        if weightless_dir is not None and rank > 0:
            cases = followers_without_weights(weightless_dir)
        for name, make in cases.items():
            result[name] = check_case(make(), tp)
        if weightless_dir is not None:
            result["mismatch"] = mismatched(tp)
        tp.close()
    except Exception:  # noqa: BLE001 -- the test reads the traceback
        result["error"] = traceback.format_exc()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    elif "error" in result or "mismatch" in result:
        with open(f"{out}.rank{rank}", "w") as f:
            json.dump(result, f)
    if device == "cuda":   # as a worker's rank: NCCL's teardown at exit can wait forever
        os._exit(0)


def followers_without_weights(weightless_dir: str) -> dict:
    """Every case's model as a follower builds it: from a config, every tensor on the meta
    device; transformers' checkpoint loading refuses to run."""
    from transformers import AutoModelForCausalLM
    from qmigrate.hub.loading import load_structure, model_structure

    def refuse(*args, **kwargs):
        raise AssertionError("a follower rank loaded a checkpoint")
    AutoModelForCausalLM.from_pretrained = refuse
    cases = {"tiny": lambda: load_structure(weightless_dir)}
    cases.update({f: (lambda f=f: model_structure(random_config(f))) for f in FAMILIES})
    cases.update({f: (lambda f=f: model_structure(families.family_config(f))) for f in SHARED_FAMILIES})
    return cases


def mismatched(tp: TensorParallel) -> str:
    """Rank 0 holds the llama case; the others expect it with a narrower MLP: the error each
    rank's engine raises at startup."""
    from qmigrate.hub.loading import model_structure
    from qmigrate.engine.parallel.sharding import LayoutError
    if tp.is_leader:
        model = random_model("llama")
    else:
        cfg = random_config("llama")
        cfg.intermediate_size = 64
        model = model_structure(cfg)
    try:
        Engine(model, tp=tp, runner="fast", max_model_len=64, max_kv_tokens=512)
    except LayoutError as exc:
        return str(exc)
    return "no error"

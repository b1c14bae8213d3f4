"""Models of real shapes without weights (hub/shapes.py) served with load_format dummy
(hub/dummy.py): the published shapes' directories, small dummy shapes of a dense and a
mixture-of-experts family built on the CPU, run by the fast runner, and served end to end
through `qmigrate sim --load-format dummy` (two workers, and a tensor-parallel worker), each
output equal to generate() on the same dummy model built here."""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml

from qmigrate.hub.dummy import DUMMY_STD
from qmigrate.hub.loading import ModelLoadError, load_model
from qmigrate.hub.shapes import SHAPES, shape_config, write_shape

VOCAB = 2000   # past the tiny tokenizer's 1,500 ids: those the model emits decode as no text

TINY_DENSE = dict(shape_config("llama-3.1-8b"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                  rope_scaling=None)
TINY_MOE = dict(shape_config("qwen3-30b-a3b"), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("shapes")
    return {name: write_shape(cfg, tiny_model_dir, root / name)
            for name, cfg in (("dense", TINY_DENSE), ("moe", TINY_MOE))}


def test_a_shape_directory_holds_the_config_and_tokenizer_and_no_weights(shapes, tiny_model_dir):
    d = shapes["dense"]
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith((".safetensors", ".bin"))]
    config = json.loads((d / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["hidden_size"] == 64
    # the token ids are the tokenizer's (the tiny one's </s> is id 2), not Llama 3's 128001
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1
    with pytest.raises(ModelLoadError, match="load-format dummy"):   # the checkpoint is what is missing
        load_model(d, "cpu")


def test_every_published_shape_builds_its_model_on_the_meta_device(tmp_path, tiny_model_dir):
    """Each published config makes the transformers model it names, at its size (checked
    against the parameter counts its publishers give, within 2%), without a byte of weights."""
    from qmigrate.hub.loading import load_structure
    billions = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "qwen2.5-7b": 7.62, "mistral-7b": 7.24,
                "qwen3-30b-a3b": 30.5, "mixtral-8x7b": 46.7}
    assert set(billions) == set(SHAPES)
    for name, expected in billions.items():
        model = load_structure(write_shape(shape_config(name), tiny_model_dir, tmp_path / name), "bfloat16")
        n = sum(p.numel() for p in model.parameters()) / 1e9
        assert abs(n - expected) / expected < 0.02, (name, n)
        assert model.config.model_type == SHAPES[name]["model_type"]


def test_an_unknown_shape_is_named():
    with pytest.raises(ValueError, match="known: llama-3.1-8b"):
        shape_config("gpt-5")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_dummy_weights_are_small_random_and_the_same_each_time(shapes, kind):
    a, _ = load_model(shapes[kind], "cpu", load_format="dummy")
    b, _ = load_model(shapes[kind], "cpu", load_format="dummy")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        if p.dim() >= 2:
            assert abs(float(p.detach().std()) - DUMMY_STD) < 0.2 * DUMMY_STD, name
        else:   # norms of one, biases of zero: the model's own initialisation
            assert torch.isfinite(p).all(), name
    assert a.model.embed_tokens.weight.shape == (VOCAB, 64)


def test_an_unknown_load_format_is_refused(shapes):
    with pytest.raises(ValueError, match="load_format"):
        load_model(shapes["dense"], "cpu", load_format="safetensors")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_fast_runner_runs_a_dummy_shape_as_generate_does(shapes, kind):
    from qmigrate.engine.engine import Engine
    from qmigrate.engine.rows import StepRow
    model, _ = load_model(shapes[kind], "cpu", load_format="dummy")
    engine = Engine(model, runner="fast", max_model_len=128, max_kv_tokens=512, max_num_seqs=4, max_num_batched_tokens=128)
    assert engine.runner.name == "fast"
    prompt = [1] + [random.Random(3).randrange(3, VOCAB) for _ in range(20)]
    out, row = [], StepRow(0, prompt, 0, 0)
    for i in range(8):
        (token,) = engine.step([row])
        out.append(token)
        row = StepRow(0, [token], len(prompt) + i, i + 1)
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref


def _sim_topology(path, shape, tp: int) -> None:
    from qmigrate.config import local_topology
    data = local_topology(1 if tp > 1 else 2, str(shape), input="jsonl", output="jsonl").to_dict()
    for w in data["workers"]:
        w.update(max_kv_tokens=2048, max_num_seqs=4)
        if tp > 1:
            w["tensor_parallel_size"] = tp
    path.write_text(yaml.safe_dump(data))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,tp", [("dense", 1), ("moe", 1), ("dense", 2)])
def test_sim_serves_a_dummy_shape_as_generate_does(shapes, kind, tp, tmp_path, qmigrate):
    """Text prompts through the tokenizer the shape carries; every output is generate()'s on
    the same dummy model (the workers made the same weights), and the text is the decoding of
    the ids the tokenizer knows: the rest print as nothing."""
    from transformers import AutoTokenizer
    shape = shapes[kind]
    topo = tmp_path / "topo.yaml"
    _sim_topology(topo, shape, tp)
    tokenizer = AutoTokenizer.from_pretrained(shape)
    requests = [{"id": f"r{i}", "prompt": text, "max_new_tokens": 12}
                for i, text in enumerate(["the old sailor carried a broken umbrella", "every student counted",
                                          "a quiet engineer repaired the village bridge at noon"])]
    run = qmigrate("sim", str(topo), "--load-format", "dummy",
                   stdin="".join(json.dumps(r) + "\n" for r in requests), timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    finals = run.finals()
    model, _ = load_model(shape, "cpu", load_format="dummy")
    past_tokenizer = 0
    for r in requests:
        ids = torch.tensor([tokenizer(r["prompt"]).input_ids])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        got = finals[r["id"]]
        assert got["token_ids"] == ref, r["id"]
        known = [t for t in ref if t < len(tokenizer)]
        past_tokenizer += len(ref) - len(known)
        assert got["text"] == tokenizer.decode(known, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert past_tokenizer > 0   # the case this checks came up


def _run(engine, prompt: list[int], start_index: int, n: int, seq_id: int = 0) -> list[int]:
    """n tokens of one sequence on `engine`, from its whole ids (a recompute when start_index > 0)."""
    from qmigrate.engine.rows import StepRow
    out, row = [], StepRow(seq_id, list(prompt), 0, start_index)
    for i in range(n):
        (token,) = engine.step([row])
        out.append(token)
        row = StepRow(seq_id, [token], len(prompt) + i, start_index + i + 1)
    engine.release(seq_id)
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_sequence_moved_between_two_workers_of_dummy_weights_goes_on_as_if_it_stayed(shapes, kind):
    """Each worker makes its own dummy weights: a sequence moved after 5 tokens (by recompute
    on a second engine, which another load made) continues with the tokens it gets unmoved."""
    from qmigrate.engine.engine import Engine
    engines = [Engine(load_model(shapes[kind], "cpu", load_format="dummy")[0], max_model_len=128, max_kv_tokens=512,
                      max_num_seqs=4, max_num_batched_tokens=128) for _ in range(2)]
    prompt = [1] + [random.Random(5).randrange(3, VOCAB) for _ in range(12)]
    stayed = _run(engines[0], prompt, 0, 10)
    first = _run(engines[0], prompt, 0, 5)
    moved = first + _run(engines[1], prompt + first, 5, 5)
    assert moved == stayed


def test_load_format_is_a_model_setting_and_a_serve_flag(tmp_path, tiny_model_dir, qmigrate):
    from qmigrate.config import ConfigError, local_topology, parse_topology
    from qmigrate.serve import ServeOptions, serve_topology
    data = local_topology(1).to_dict()
    data["model"]["load_format"] = "dummy"
    assert parse_topology(data).model.load_format == "dummy"
    data["model"]["load_format"] = "pt"
    with pytest.raises(ConfigError, match="load_format"):
        parse_topology(data)
    assert serve_topology(ServeOptions(load_format="dummy")).model.load_format == "dummy"
    assert serve_topology(ServeOptions()).model.load_format == "auto"
    run = qmigrate("model", "shape", "mistral-7b", str(tmp_path / "m"), "--tokenizer", str(tiny_model_dir))
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "m" / "config.json").read_text())["sliding_window"] == 4096
    run = qmigrate("model", "shape", "gpt-5", str(tmp_path / "g"), "--tokenizer", str(tiny_model_dir))
    assert run.returncode != 0 and "known: llama-3.1-8b" in run.stderr


@pytest.mark.parametrize("kind", ["dense", "moe", "tied"])
def test_each_rank_makes_the_slices_of_the_dummy_model_it_holds(shapes, kind, tmp_path, tiny_model_dir):
    """A tensor-parallel rank makes its own shard from the model's structure (dummy_shard.py),
    one layer at a time: every tensor equals, in order, shape, dtype and value, the one cut for
    that rank from the whole dummy model load_model makes (rotary tables, norms, vocab-split
    embeddings and head, each expert's slice), and the structure is left on the meta device."""
    from qmigrate.engine import models
    from qmigrate.engine.parallel.dummy_shard import dummy_shard
    from qmigrate.engine.parallel.scatter import shard_tensors
    from qmigrate.engine.parallel.sharding import TensorParallel, shard_model
    from qmigrate.hub.loading import load_structure
    shape = (write_shape(dict(TINY_DENSE, tie_word_embeddings=True), tiny_model_dir, tmp_path / "tied")
             if kind == "tied" else shapes[kind])
    for dtype in ("float32", "bfloat16"):
        whole = models.build(load_model(shape, "cpu", dtype, load_format="dummy")[0])
        for rank in range(2):
            cut = shard_tensors(shard_model(whole, TensorParallel(rank, 2, "cpu")))
            structure = load_structure(shape, dtype)
            made = shard_tensors(dummy_shard(structure, TensorParallel(rank, 2, "cpu")))
            assert len(made) == len(cut)
            for i, (a, b) in enumerate(zip(made, cut)):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (dtype, rank, i)
            assert all(p.device.type == "meta" for p in structure.parameters())
            assert all(b.device.type == "meta" for b in structure.buffers())


def test_a_rank_holds_one_whole_layer_at_a_time(shapes):
    """The layers are made on the device as the shard asks for them: when one is handed out,
    every other layer's module is still (or again) on the meta device."""
    from qmigrate.engine import models
    from qmigrate.engine.parallel.dummy_shard import _layers_made
    from qmigrate.hub.dummy import materialize
    from qmigrate.hub.loading import load_structure
    model = load_structure(shapes["moe"], "float32")
    layers = model.model.layers
    saved, model.model.layers = layers, torch.nn.ModuleList()
    materialize(model, model, torch.device("cpu"))
    model.model.layers = saved
    made = []
    for i, layer in enumerate(_layers_made(model, models.decoder_layers(model), torch.device("cpu"), 0)):
        real = [j for j, m in enumerate(layers) if any(p.device.type != "meta" for p in m.parameters())]
        assert real == [i]
        assert layer.attn.qkv.weight.device.type == "cpu"
        made.append(i)
    assert made == list(range(len(layers)))
    assert all(p.device.type == "meta" for m in layers for p in m.parameters())


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "mixtral",
                                    "qwen2_moe", "qwen3_moe"])
def test_every_family_shard_made_by_a_rank_is_the_dummy_models_slice(family, tmp_path):
    """The same for every fast-runner family (tests/families.py's configs): tied embeddings,
    rotary tables per layer type (Gemma 3), LongRoPE (Phi-3), a shared expert and dense layers
    among the experts (Qwen2-MoE)."""
    import families
    from qmigrate.engine import models
    from qmigrate.engine.parallel.dummy_shard import dummy_shard
    from qmigrate.engine.parallel.scatter import shard_tensors
    from qmigrate.engine.parallel.sharding import TensorParallel, shard_model
    from qmigrate.hub.dummy import build_dummy_model
    from qmigrate.hub.loading import attention_implementation, model_structure
    config = families.family_config(family)
    config.save_pretrained(tmp_path)
    whole = models.build(build_dummy_model(tmp_path, "cpu", torch.float32, attention=attention_implementation))
    for rank in range(2):
        cut = shard_tensors(shard_model(whole, TensorParallel(rank, 2, "cpu")))
        made = shard_tensors(dummy_shard(model_structure(config, "float32"), TensorParallel(rank, 2, "cpu")))
        assert len(made) == len(cut)
        for i, (a, b) in enumerate(zip(made, cut)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (rank, i)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_on_a_gpu_each_rank_makes_the_slices_of_the_dummy_model(shapes, kind):
    """As on the CPU, with the weights drawn on the GPU in bf16 (CUDA's generator): each
    shard a rank makes equals the slice of the whole dummy model load_model makes there."""
    from qmigrate.engine import models
    from qmigrate.engine.parallel.dummy_shard import dummy_shard
    from qmigrate.engine.parallel.scatter import shard_tensors
    from qmigrate.engine.parallel.sharding import TensorParallel, shard_model
    from qmigrate.hub.loading import load_structure
    whole = models.build(load_model(shapes[kind], "cuda", "bfloat16", load_format="dummy")[0])
    for rank in range(2):
        cut = shard_tensors(shard_model(whole, TensorParallel(rank, 2, "cuda:0")))
        made = shard_tensors(dummy_shard(load_structure(shapes[kind], "bfloat16"), TensorParallel(rank, 2, "cuda:0")))
        assert len(made) == len(cut)
        for i, (a, b) in enumerate(zip(made, cut)):
            assert a.device.type == "cuda" and a.dtype == b.dtype and a.shape == b.shape, (rank, i)
            assert torch.equal(a, b), (rank, i)

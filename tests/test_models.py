import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from qmigrate.hub import builders as models
from qmigrate.hub.loading import (
    ModelLoadError,
    ModelNotFound,
    cache_root,
    default_model_dir,
    ensure_default_model,
    load_model,
    resolve_model,
)
from qmigrate.hub.builders import build_bench_model, build_tiny_model
from qmigrate.hub.store import BUILD_MARKER

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The old sailor carried", "Hello there, how are you today?", "我们明天早上"]
SMALL_BENCH_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, "cpu")


def test_tiny_build_is_deterministic(tiny_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    a, b, c = (load_file(d / "model.safetensors") for d in (tiny_dir, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tiny_dir / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    tok_a, tok_b = AutoTokenizer.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(again)
    text = "Déjà vu: 东京 😀 costs $4.50"
    assert tok_a(text).input_ids == tok_b(text).input_ids


def test_tiny_loads_through_from_pretrained(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.max_position_embeddings == 512
    assert model.dtype == torch.float32
    assert cfg.vocab_size == len(tok)
    assert 1000 <= len(tok) <= 2000
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    ids = tok("hello world").input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"


def test_load_model_cpu(tiny):
    model, tok = tiny
    assert not model.training
    assert next(model.parameters()).device.type == "cpu"
    assert model.dtype == torch.float32


def test_greedy_output_is_not_degenerate(tiny):
    model, tok = tiny
    outputs = []
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        new = out[0, enc.input_ids.shape[1]:].tolist()
        assert len(set(new)) >= 4, f"degenerate greedy output for {prompt!r}: {new}"
        outputs.append(tuple(new))
    assert len(set(outputs)) == len(PROMPTS)


def test_greedy_top_logits_are_not_tied(tiny):
    model, tok = tiny
    with torch.no_grad():
        logits = model(**tok(PROMPTS, return_tensors="pt", padding=True)).logits
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-4


def test_multibyte_character_splits_across_tokens(tiny):
    _, tok = tiny
    for char in ["🦀", "龍"]:
        ids = tok(char, add_special_tokens=False).input_ids
        assert len(ids) >= 2, (char, ids)
        assert tok.decode(ids) == char
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    text = "Grüße aus Köln, 東京 and 🚀!"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text


def test_default_model_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QMIGRATE_CACHE", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache"
    monkeypatch.delenv("QMIGRATE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache" / "qmigrate" / "tiny-llama-v1"


def test_cache_root_is_beside_the_tiny_model(monkeypatch, tmp_path):
    monkeypatch.setenv("QMIGRATE_CACHE", str(tmp_path / "tiny"))
    assert cache_root() == tmp_path
    monkeypatch.delenv("QMIGRATE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "qmigrate" == default_model_dir().parent


def test_ensure_default_model_builds_once(monkeypatch, tmp_path):
    monkeypatch.setenv("QMIGRATE_CACHE", str(tmp_path / "cache"))
    first = ensure_default_model()
    assert first == tmp_path / "cache"
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert resolve_model(None) == str(first)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_concurrent_builds_race_safely(tmp_path, tiny_model_dir):
    """Two processes build one model into one directory at once: each waits inside its build
    until the other is there too, so both renames race. One wins, the other returns the
    winner's build, and no temporary directory is left. (The builds copy the tiny model, so
    the processes need no torch: the race is build_atomically's, whatever the model.)"""
    out, gate = tmp_path / "raced", tmp_path / "gate"
    gate.mkdir()
    code = ("import os, shutil, sys, time\n"
            "from pathlib import Path\n"
            "from qmigrate.hub.store import build_atomically\n"
            "src, out, gate, me = sys.argv[1:]\n"
            "def write(tmp):\n"
            "    for f in Path(src).iterdir():\n"
            "        shutil.copy(f, tmp)\n"
            "    Path(gate, me).touch()\n"
            "    deadline = time.monotonic() + 60\n"
            "    while len(os.listdir(gate)) < 2 and time.monotonic() < deadline:\n"
            "        time.sleep(0.005)\n"
            "print(build_atomically(out, {'builder': 'raced'}, write))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tiny_model_dir), str(out), str(gate), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = [p.communicate(timeout=90) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr
        assert stdout.strip() == str(out)
    assert sorted(p.name for p in gate.iterdir()) == ["0", "1"]   # both were building at once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate", "raced"]
    assert json.loads((out / BUILD_MARKER).read_text()) == {"builder": "raced"}
    AutoModelForCausalLM.from_pretrained(out)


def test_build_into_empty_dir_and_refuse_foreign_dir(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_tiny_model(empty) == empty
    assert (empty / "config.json").exists()
    with pytest.raises(FileExistsError):
        build_tiny_model(empty, seed=3)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_resolve_model(tmp_path, monkeypatch):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    assert resolve_model("./local") == str(tmp_path / "local")
    for missing in ["/no/such/model", "./nope", "../nope", "~/no-such-qmigrate-model", "a/b/c"]:
        with pytest.raises(ModelNotFound, match="model directory not found: "):
            resolve_model(missing)
    assert issubclass(ModelNotFound, ValueError)
    assert resolve_model("TinyLlama/TinyLlama-1.1B-Chat-v1.0") == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    assert resolve_model("gpt2") == "gpt2"


def test_load_model_errors_name_the_path(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ModelLoadError, match=str(missing)) as info:
        load_model(missing, "cpu")
    assert "\n" not in str(info.value)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="broken"):
        load_model(broken, "cpu")


def test_load_model_dtype(tiny_dir):
    model, _ = load_model(tiny_dir, "cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tiny_dir, "cpu", dtype="float7")


def test_bench_model_small_shape(tmp_path):
    out = build_bench_model(tmp_path / "bench", seed=0, shape_overrides=SMALL_BENCH_SHAPE)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 32000
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["hidden_size"] == 64 and cfg["num_key_value_heads"] == 2
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == 32000
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 32000
    assert all(tok.decode([i]) for i in range(10, 31001))
    text = "The old sailor 🚀 東京"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text

    model, _ = load_model(out, "cpu")
    with torch.no_grad():
        logits = model(torch.tensor([[1, 10, 31000, 500]])).logits
    assert logits.shape == (1, 4, 32000) and torch.isfinite(logits).all()


def test_bench_model_full_shape_defaults():
    assert models.BENCH_SHAPE == dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5)
    assert models.BENCH_VOCAB_SIZE == 32000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_model_cuda(tiny_dir):
    model, tok = load_model(tiny_dir, "cuda")
    assert model.dtype == torch.bfloat16
    assert next(model.parameters()).device.type == "cuda"
    enc = tok(PROMPTS[0], return_tensors="pt").to("cuda")
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > enc.input_ids.shape[1]


def test_tokenizer_info_without_torch_matches_autotokenizer(tiny_model_dir, tmp_path):
    """Ingest and the detokenizer read a generic fast tokenizer without AutoConfig, which
    imports torch; what they get equals AutoTokenizer's. Anything else takes AutoTokenizer."""
    import json
    import shutil
    import subprocess
    import sys

    from qmigrate.hub.tokenizer_info import _auto_tokenizer_info, _generic_tokenizer_info, load_tokenizer_info
    fast, auto = _generic_tokenizer_info(tiny_model_dir), _auto_tokenizer_info(tiny_model_dir, False)
    assert fast is not None and type(fast[0]) is type(auto[0]) and fast[1:] == auto[1:]
    for text in ("Hello there 東京 🦀 café", "  two leading spaces", ""):
        ids = auto[0](text).input_ids
        assert fast[0](text).input_ids == ids and fast[0].decode(ids) == auto[0].decode(ids)
    probe = ("import sys; from qmigrate.hub.tokenizer_info import load_tokenizer_info as f; "
             f"print(f({str(tiny_model_dir)!r})[1:], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "(512, [2]) False", out
    # A tokenizer class of its own, or a nested text config: the general path, same answer.
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert _generic_tokenizer_info(other) is None
    assert load_tokenizer_info(other)[1:] == (512, [2])


def test_ingest_tokenizes_as_autotokenizer_whatever_the_model_type(tiny_model_dir, tmp_path):
    """A checkpoint that names the generic tokenizer under a config whose model type has a
    tokenizer class of its own in transformers (qwen2: Qwen2Tokenizer, which pre-tokenizes
    digits its own way): ingest's ids are AutoTokenizer's, and the files are read directly
    only for model types where AutoTokenizer keeps the generic class."""
    import json
    import shutil

    from transformers import AutoTokenizer
    from qmigrate.hub import tokenizer_info
    texts = ("0 1 2 3", "Item 42: 3.14 costs $7", "Hello there 東京 café")
    for model_type in ("qwen2",) + tokenizer_info._GENERIC_MODEL_TYPES:
        path = tmp_path / model_type
        shutil.copytree(tiny_model_dir, path)
        config = json.loads((path / "config.json").read_text())
        config.pop("architectures", None)
        (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        auto = AutoTokenizer.from_pretrained(str(path))
        ingest = tokenizer_info.load_tokenizer_info(path)[0]
        for text in texts:
            assert ingest(text).input_ids == auto(text).input_ids, (model_type, text)
        if model_type in tokenizer_info._GENERIC_MODEL_TYPES:
            assert type(auto).__name__ in tokenizer_info._GENERIC_TOKENIZERS, model_type
            assert tokenizer_info._generic_tokenizer_info(path) is not None

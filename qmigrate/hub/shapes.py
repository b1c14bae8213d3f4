"""Models of real shapes without their weights: a directory holding a published config and a
tokenizer, which a worker serves with `load_format: dummy` (hub/dummy.py builds the weights on
the device). The architecture fields below are those of each model's published config.json on
the Hugging Face hub; the token ids (bos, eos, pad) are the tokenizer's, since the tokenizer is
not the model's own. The vocabulary size stays the model's: ids past the tokenizer decode as
no text."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from qmigrate.hub.store import build_atomically

_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}

SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False),
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
        max_window_layers=28, sliding_window=131072, use_sliding_window=False, tie_word_embeddings=False),
    # mistralai/Mistral-7B-v0.1
    "mistral-7b": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
        hidden_act="silu", tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", attention_bias=False,
        max_window_layers=48, sliding_window=None, use_sliding_window=False, tie_word_embeddings=False),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1000000.0, sliding_window=None, hidden_act="silu", tie_word_embeddings=False),
}

# The files of a tokenizer directory a shape takes (those present are copied).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


def shape_config(name: str) -> dict:
    try:
        return dict(SHAPES[name])
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}") from None


def write_shape(config: dict, tokenizer_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A model directory of `config` (a config.json's fields) with the tokenizer of
    `tokenizer_dir`, and no weights: serve it with load_format dummy."""
    src = Path(tokenizer_dir)
    files = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in files):
        raise ValueError(f"{src} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    tok_file = src / "tokenizer_config.json"
    tok_config = json.loads(tok_file.read_text()) if tok_file.is_file() else {}
    config = dict(config) | _token_ids(src, tok_config)
    config.setdefault("torch_dtype", "bfloat16")
    config.setdefault("initializer_range", 0.02)
    if config.get("vocab_size", 0) < 1 or "model_type" not in config:
        raise ValueError("a shape needs model_type and vocab_size")
    identity = {"builder": "shape", "config": config, "tokenizer": sorted(f.name for f in files)}

    def write(tmp: Path) -> None:
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return build_atomically(out_dir, identity, write)


def _token_ids(tokenizer_dir: Path, tok_config: dict) -> dict:
    """bos/eos/pad ids of the tokenizer, by the names its config gives them."""
    try:
        vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return {}
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", []) if isinstance(t, dict)}
    ids |= {k: v for k, v in (vocab.get("model", {}).get("vocab") or {}).items() if k in
            {_name(tok_config.get(n)) for n in ("bos_token", "eos_token", "pad_token")}}
    out = {}
    for field, key in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"), ("pad_token_id", "pad_token")):
        name = _name(tok_config.get(key))
        if name in ids:
            out[field] = ids[name]
    return out


def _name(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token

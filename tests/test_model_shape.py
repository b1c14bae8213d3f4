"""ModelShape: the one reading of a transformers config that the engine, the worker's hello
and the tensor-parallel check share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlavaConfig, Qwen2MoeConfig

from qmigrate.engine.engine import Engine
from qmigrate.hub.shape import ModelShape

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=256)


def test_the_shape_of_a_config():
    shape = ModelShape.from_config(LlamaConfig(**SMALL, num_key_value_heads=2))
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (3, 4, 2, 16)
    assert (shape.hidden_size, shape.vocab_size, shape.max_context, shape.mlp_widths) == (64, 300, 256, (96,))
    assert shape.num_params == 0
    assert shape.kv_bytes_per_token(2) == 2 * 3 * 2 * 16 * 2
    with pytest.raises(AttributeError):   # frozen
        shape.num_layers = 4


def test_kv_heads_default_to_the_attention_heads_and_an_explicit_head_dim_wins():
    cfg = LlamaConfig(**SMALL, head_dim=32)
    cfg.num_key_value_heads = None
    shape = ModelShape.from_config(cfg)
    assert (shape.num_kv_heads, shape.head_dim) == (4, 32)


def test_a_multimodal_config_gives_its_language_model_and_experts_give_every_width():
    llava = LlavaConfig(text_config=LlamaConfig(**SMALL, num_key_value_heads=1).to_dict())
    assert ModelShape.from_config(llava).num_kv_heads == 1
    assert ModelShape.from_config(llava).num_layers == 3
    moe = Qwen2MoeConfig(intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
    assert ModelShape.from_config(moe).mlp_widths == (1408, 5632)


def test_the_engine_reads_its_shape_from_the_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=2)).eval()
    engine = Engine(model, max_kv_tokens=256)
    shape = engine.shape
    assert shape == ModelShape.from_config(model.config, num_params=sum(p.numel() for p in model.parameters()))
    assert shape.num_params > 0
    assert engine.kv_bytes_per_token == 2 * 3 * 2 * 16 * 4   # fp32
    pool = engine.pool
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim) == (3, 2, 16)
    assert engine.max_len == 256


def test_a_config_without_a_context_length_says_zero():
    assert ModelShape.from_config(SimpleNamespace(**{**SMALL, "max_position_embeddings": None})).max_context == 0
    assert ModelShape.from_config(SimpleNamespace(**SMALL)).num_kv_heads == 4   # no num_key_value_heads

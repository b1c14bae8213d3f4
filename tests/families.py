"""Small random-weight models of every family the fast runner defines, built offline from the
families' transformers config classes (shared by the CPU and GPU family tests)."""

from __future__ import annotations

import torch

WINDOW = 8  # sliding windows this short are crossed by every test's contexts
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _configs() -> dict:
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    gemma = dict(SMALL, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                 hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=5.0)
    rotary = 8  # Phi: half of each head of 16 rotates
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary // 2)],
                "long_factor": [2.0 + 0.5 * i for i in range(rotary // 2)],
                "original_max_position_embeddings": 128}
    return {
        "llama3": lambda: LlamaConfig(**SMALL, rope_parameters=llama3, tie_word_embeddings=True),
        "qwen2": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False),
        "mistral": lambda: MistralConfig(**SMALL, sliding_window=WINDOW, tie_word_embeddings=False),
        "gemma2": lambda: Gemma2Config(**gemma, attn_logit_softcapping=2.0),
        "gemma3": lambda: Gemma3TextConfig(**gemma, layer_types=["sliding_attention", "full_attention"],
                                           rope_parameters={
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
        "phi3": lambda: Phi3Config(**SMALL, rope_parameters=longrope, partial_rotary_factor=0.5,
                                   tie_word_embeddings=False),
        "mixtral": lambda: MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2,
                                         sliding_window=None, tie_word_embeddings=False),
        # the second layer dense (decoder_sparse_step 2 makes only every second layer sparse)
        "qwen2_moe": lambda: Qwen2MoeConfig(**dict(SMALL, num_hidden_layers=3), num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                            norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False),
        "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, norm_topk_prob=True,
                                            tie_word_embeddings=False),
    }


FAMILY_NAMES = ("llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe",
                "qwen3_moe")


def family_config(name: str):
    return _configs()[name]()


def build_family_model(name: str, dtype=torch.float32, device="cpu", seed: int = 0):
    """A transformers model of the family with random weights large enough for sharp,
    input-dependent logits (a std of 0.02 gives near-uniform ones); eager attention, the
    implementation every family's soft-capping and windows are defined by."""
    from transformers import AutoModelForCausalLM
    config = family_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)       # biases
            elif "embed" in key:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                sharp = "lm_head" in key or key.endswith("mlp.gate.weight")  # decisive logits and routing
                std = (3.0 if sharp else 0.6) / p.shape[-1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.to(device=device, dtype=dtype).eval()

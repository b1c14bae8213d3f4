"""`load_format: dummy` (vLLM's name): a model built from its config alone, its weights made on
the device in their real shapes and dtypes and filled with small random values. No checkpoint
is read, so a model directory needs only config.json and a tokenizer (hub/shapes.py writes
such directories); what a step costs does not depend on the values."""

from __future__ import annotations

import os

LOAD_FORMATS = ("auto", "dummy")
DUMMY_STD = 0.02   # the usual initializer_range: activations stay finite through every layer


def build_dummy_model(path: str | os.PathLike, device: str, torch_dtype, *, trust_remote_code: bool = False,
                      seed: int = 0, attention=lambda config: "sdpa"):
    """The model of the config at `path` on `device` in `torch_dtype`, its matrices (and the
    experts' stacked matrices) drawn from N(0, DUMMY_STD) with a fixed seed; vectors keep the
    values the model's own initialisation gives them (norms of one, biases of zero).
    `attention(config)` names the attention implementation to ask for."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype,
                                                 attn_implementation=attention(config),
                                                 trust_remote_code=trust_remote_code)
    fill_dummy(model, seed)
    return model.eval()


def fill_dummy(model, seed: int = 0) -> None:
    import torch
    gen = None
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() < 2 or not p.is_floating_point():
                continue
            if gen is None or gen.device != p.device:
                gen = torch.Generator(p.device).manual_seed(seed)
            p.normal_(0.0, DUMMY_STD, generator=gen)

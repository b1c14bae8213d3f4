"""`load_format: dummy` (vLLM's name): a model built from its config alone, its weights made on
the device in their real shapes and dtypes and filled with small random values. No checkpoint
is read, so a model directory needs only config.json and a tokenizer (hub/shapes.py writes
such directories); what a step costs does not depend on the values.

Each weight's values are a function of its name alone (a generator seeded by the name), so a
part of the model made on its own, such as one decoder layer of a tensor-parallel rank's
(engine/parallel/dummy_shard.py), holds the values the whole model has there on that device."""

from __future__ import annotations

import hashlib
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
    with torch.no_grad():   # the rotary frequencies as materialize and a checkpoint's load make them
        for sub in model.modules():   # (computed on the CPU, then copied), not on `device`
            if hasattr(sub, "inv_freq"):
                model._init_weights(sub)
    return model.eval()


def param_seed(name: str, seed: int = 0) -> int:
    """The seed of the weight called `name` (as the whole model's named_parameters name it)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def fill_dummy(module, seed: int = 0, prefix: str = "") -> None:
    """Every matrix of `module` (dim >= 2, floating point) drawn from N(0, DUMMY_STD) by a
    generator seeded by its name; `prefix`: the module's name within the whole model."""
    import torch
    with torch.no_grad():
        for name, p in module.named_parameters(prefix=prefix):
            if p.dim() < 2 or not p.is_floating_point():
                continue
            gen = torch.Generator(p.device).manual_seed(param_seed(name, seed))
            p.normal_(0.0, DUMMY_STD, generator=gen)


def materialize(model, module, device, seed: int = 0) -> None:
    """Make `module` (a part of `model` on the meta device) on `device` as build_dummy_model
    makes it: its tensors allocated there, every submodule's values from the model's own
    initialisation (norms of one, biases of zero, rotary frequencies), then its matrices
    filled by name (fill_dummy)."""
    import torch
    prefix = next(name for name, m in model.named_modules() if m is module)
    module.to_empty(device=device)
    with torch.no_grad():
        for sub in module.modules():
            own = list(sub.parameters(recurse=False))
            if list(sub.buffers(recurse=False)) or any(p.dim() < 2 or not p.is_floating_point() for p in own):
                model._init_weights(sub)   # a module of matrices alone: fill_dummy sets them all
    fill_dummy(module, seed, prefix)

"""Where a model comes from and how it loads: built-in names, hub names, local directories,
and loading weights and tokenizer onto a device (the cache itself is store.py's)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NoReturn

from qmigrate.hub.store import (DEFAULT_MODEL_NAME, SMOLLM2_NAME, ModelLoadError, ModelNotFound, cache_root,
                                default_model_dir, parse_dtype)

__all__ = ["DEFAULT_MODEL_NAME", "SMOLLM2_NAME", "ModelLoadError", "ModelNotFound", "attention_implementation",
           "cache_root", "default_model_dir", "ensure_default_model", "fetch_hub_model", "load_model",
           "load_structure", "model_structure", "remote_code_error", "resolve_model"]

def ensure_default_model() -> Path:
    from qmigrate.hub.builders import build_tiny_model
    return build_tiny_model(default_model_dir())


_HUB_NAME = re.compile(r"^[A-Za-z0-9_][\w.-]*/[\w.-]+$")


def resolve_model(path_or_name: str | None) -> str:
    if path_or_name is None:
        return str(ensure_default_model())
    if path_or_name == SMOLLM2_NAME:  # a built-in name; a local directory of that name is ./smollm2
        from qmigrate.hub.smollm2 import ensure_smollm2_model
        return str(ensure_smollm2_model())
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return str(path.absolute())
    seps = [s for s in (os.sep, os.altsep) if s]
    looks_local = (
        path_or_name.startswith(("/", "./", "../", "~"))
        or (any(s in path_or_name for s in seps) and not _HUB_NAME.match(path_or_name))
    )
    if path.exists():
        raise ModelNotFound(f"model path is not a directory: {path}")
    if looks_local:
        raise ModelNotFound(f"model directory not found: {path}")
    return path_or_name


def fetch_hub_model(name: str) -> str:
    """The local directory of hub model `name`, downloading it once here, so that no role
    finds out on its own (and with retries) that the hub is out of reach."""
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 -- not cached yet: fetch it below
        pass
    try:
        return snapshot_download(name, etag_timeout=10)
    except Exception as exc:  # noqa: BLE001 -- hub errors come in many types; all mean "not servable"
        reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ModelNotFound(f"model {name!r} is not a local directory, and fetching it from the "
                            f"Hugging Face hub failed: {reason.strip()}") from None


def remote_code_error(path, exc: Exception) -> ModelLoadError | None:
    if "trust_remote_code" not in str(exc):
        return None
    return ModelLoadError(f"model {path} ships its own Python code; set model.trust_remote_code: true "
                          "in the topology to run it (only for a model you trust)")


def _torch_dtype(dtype: str, device: str):
    import torch
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return parse_dtype(dtype)


def attention_implementation(config) -> str | None:
    """The attention a model is loaded with: "sdpa" where its transformers class supports it,
    else "eager" (Gemma 2 has no SDPA path in some transformers releases, and asking for one
    is an error); None (transformers' own choice) for a class it does not map, such as a
    model's own code."""
    from transformers import AutoModelForCausalLM
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError, ValueError):
        return None
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def load_model(path: str | os.PathLike, device: str, dtype: str = "auto", *, trust_remote_code: bool = False,
               load_format: str = "auto"):
    """Load (model, tokenizer); dtype "auto" means float32 on the CPU and bfloat16 on a GPU.
    load_format "dummy" reads only the config and the tokenizer: the weights are made on the
    device (hub/dummy.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from qmigrate.hub.dummy import LOAD_FORMATS, build_dummy_model

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    hf_logging.disable_progress_bar()
    torch_dtype = _torch_dtype(dtype, device)
    if load_format == "auto" and _holds_no_weights(Path(path)):
        raise ModelLoadError(f"model {path} holds a config and no weights: load it with load_format dummy "
                             "(--load-format dummy) for random weights of its shapes")
    try:
        if load_format == "dummy":
            model = build_dummy_model(path, device, torch_dtype, trust_remote_code=trust_remote_code,
                                      attention=attention_implementation)
        else:
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                str(path), config=config, dtype=torch_dtype, attn_implementation=attention_implementation(config),
                trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        model = model.to(device).eval()
    except Exception as exc:  # noqa: BLE001 -- any failure here means "cannot serve this model"
        _raise_load_error(path, f"load model {path} on {device}", exc)
    return model, tokenizer


def _holds_no_weights(path: Path) -> bool:
    return (path / "config.json").is_file() and not any(
        f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf") for f in path.iterdir())


def _raise_load_error(path, what: str, exc: Exception) -> NoReturn:
    """For a failure to `what`: ModelLoadError with the first line of its reason, or the
    remote-code refusal when that is what it was."""
    if (refused := remote_code_error(path, exc)) is not None:
        raise refused from None
    reason = (str(exc).strip().splitlines() or [""])[0]
    raise ModelLoadError(f"cannot {what}: {type(exc).__name__}: {reason}") from exc


def model_structure(config, dtype: str = "float32", *, trust_remote_code: bool = False):
    """The model of a transformers config with no weights: its modules, every tensor on the
    meta device in `dtype` (a tensor-parallel follower's: its shard comes from rank 0)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype, "cpu"),
                                                 attn_implementation=attention_implementation(config),
                                                 trust_remote_code=trust_remote_code)
    return model.eval()


def load_structure(path: str | os.PathLike, dtype: str = "float32", *, trust_remote_code: bool = False):
    """model_structure of the checkpoint at `path`: only its config is read."""
    from transformers import AutoConfig
    _torch_dtype(dtype, "cpu")   # an unknown dtype is the caller's ValueError, not a load error
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        return model_structure(config, dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 -- as load_model
        _raise_load_error(path, f"build model {path} without weights", exc)

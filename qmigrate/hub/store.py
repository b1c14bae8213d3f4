"""The model store: built-in model names, the cache directory they are built in, building
into it atomically, and the errors of finding and loading a model. Nothing here imports torch
at module level: the roles that only tokenize use it too."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_NAME = "tiny-llama-v1"
SMOLLM2_NAME = "smollm2"  # a trained model, fetched and converted on first use (smollm2.py)
BUILD_MARKER = "qmigrate_build.json"


class ModelNotFound(ValueError):
    pass


class ModelLoadError(RuntimeError):
    pass


def build_atomically(out_dir: str | os.PathLike, identity: dict, write) -> Path:
    """Build into a temp dir next to out_dir and rename it into place; first writer wins."""
    out = Path(out_dir).expanduser().absolute()
    if _matches(out, identity):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        (tmp / BUILD_MARKER).write_text(json.dumps(identity, sort_keys=True) + "\n")
        # mkdtemp makes a private dir; a model cache is meant to be readable by others
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            os.rename(tmp, out)  # replaces an empty dir; fails on a non-empty one
        except OSError:
            if _matches(out, identity):  # another process won the race with the same build
                return out
            raise FileExistsError(f"{out} exists and does not hold this built-in model") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _matches(out: Path, identity: dict) -> bool:
    try:
        return json.loads((out / BUILD_MARKER).read_text()) == identity
    except (OSError, ValueError):
        return False


def default_model_dir() -> Path:
    cache = os.environ.get("QMIGRATE_CACHE")
    if cache:
        return Path(cache).expanduser()
    return Path.home() / ".cache" / "qmigrate" / DEFAULT_MODEL_NAME


def cache_root() -> Path:
    """Where built-in models other than the tiny one are built: beside the tiny model.
    QMIGRATE_CACHE names the tiny model's own directory, so the others cannot go inside it."""
    return default_model_dir().parent


_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return getattr(torch, _DTYPE_NAMES[str(dtype).lower().removeprefix("torch.")])
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)} or 'auto'") from None

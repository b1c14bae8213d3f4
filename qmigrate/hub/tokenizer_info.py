"""What the roles that never run the model need of it: the tokenizer, the context length and
the EOS ids. A generic fast tokenizer with a plain config is read from the files, so those
processes never import torch; anything else goes through AutoTokenizer and AutoConfig."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qmigrate.hub.loading import remote_code_error
from qmigrate.hub.shape import context_length, text_config
from qmigrate.hub.store import ModelLoadError

# Tokenizer classes AutoTokenizer resolves to transformers' generic fast tokenizer itself.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types (config.json's) for which AutoTokenizer keeps the generic tokenizer that a
# checkpoint names. For some others it substitutes a class of its own whatever the checkpoint
# says (Qwen2Tokenizer for qwen2, whose pre-tokenizer splits "0 1 2 3" into other ids than the
# tokenizer.json it was given); which ones depends on the transformers release, and telling
# needs its auto module, which imports torch. So the files are read directly only for these
# types, each checked against AutoTokenizer by the tests; every other type takes AutoTokenizer.
_GENERIC_MODEL_TYPES = ("llama", "mistral", "mixtral")


def load_tokenizer_info(path: str | os.PathLike, trust_remote_code: bool = False):
    """(tokenizer, context length, EOS ids) for the roles that never run the model."""
    found = _generic_tokenizer_info(Path(path))
    if found is None:
        found = _auto_tokenizer_info(path, trust_remote_code)
    tokenizer, max_context, eos = found
    # Ingest refuses a prompt too long for the context with its own per-request error; the
    # tokenizer's warning about the same prompt would only leak to stderr.
    tokenizer.model_max_length = 1 << 62
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or ()))
    return tokenizer, max_context, eos_ids


def _generic_tokenizer_info(path: Path):
    """The same as _auto_tokenizer_info, read from the files, for a checkpoint whose tokenizer
    is transformers' generic fast tokenizer and whose config is a plain one of a model type
    AutoTokenizer leaves that tokenizer to (no code of its own, no nested text config); None
    for any other. AutoConfig imports torch, which the
    ingest and detokenizer processes then never need: they start seconds sooner."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(tokenizer_config, dict) or not isinstance(config, dict)
            or tokenizer_config.get("tokenizer_class") not in _GENERIC_TOKENIZERS
            or config.get("model_type") not in _GENERIC_MODEL_TYPES
            or "auto_map" in tokenizer_config or "auto_map" in config or "text_config" in config
            or not (path / "tokenizer.json").is_file()
            or type(config.get("max_position_embeddings")) is not int or config["max_position_embeddings"] < 1):
        return None
    from transformers import PreTrainedTokenizerFast
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 -- any failure here means "cannot serve this model"
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise ModelLoadError(f"cannot load tokenizer of {path}: {type(exc).__name__}: {reason}") from exc
    eos = None
    try:
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # none, or not a JSON object
        pass
    if eos is None:
        eos = config.get("eos_token_id")
    return tokenizer, config["max_position_embeddings"], eos


def _auto_tokenizer_info(path, trust_remote_code: bool):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 -- any failure here means "cannot serve this model"
        if (refused := remote_code_error(path, exc)) is not None:
            raise refused from None
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise ModelLoadError(f"cannot load tokenizer of {path}: {type(exc).__name__}: {reason}") from exc
    config = text_config(config)
    max_context = context_length(config) or int(tokenizer.model_max_length)
    eos = None
    try:
        eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
    except Exception:  # noqa: BLE001 -- a checkpoint without generation_config.json
        pass
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    return tokenizer, max_context, eos


def max_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: the longest token string of the
    vocabulary, added tokens included. A byte-level token's string has one character per byte,
    so at least as many as the text it decodes to. So a text of L characters is at least
    L / max_token_chars tokens, a bound ingest checks before tokenizing a long prompt.
    Computed once per tokenizer (a pass over the vocabulary)."""
    cached = getattr(tokenizer, "_qmigrate_max_token_chars", None)
    if cached is None:
        cached = max(1, max(map(len, tokenizer.get_vocab()), default=1))
        try:
            tokenizer._qmigrate_max_token_chars = cached
        except AttributeError:  # a tokenizer class with slots: computed again each time
            pass
    return cached


def token_id_bound(path: str | os.PathLike, tokenizer) -> int:
    """Prompt, stop and logit-bias ids a request may name: [0, this). Every id the tokenizer
    has, and every row of the model's embedding where it has more (a vocabulary padded past
    the tokenizer's, or a model shape served with a smaller tokenizer): such a model can emit
    those ids, and a client that sends its output back as ids must be able to."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        rows = (config.get("text_config") or config).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        rows = None
    return max(len(tokenizer), rows) if isinstance(rows, int) and not isinstance(rows, bool) else len(tokenizer)

"""What a migration costs, from the model's own config.json (the checkpoint the topology
names), for the router: KV bytes a transfer ships per token, and the parameters a recompute
runs per token. Read from the files without torch; the workers' own reports of these numbers
are never used, since a worker (or a stolen worker key) gains by choosing them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True, slots=True)
class MigrationCosts:
    kv_values_per_token: int   # K and V values of one token, all layers and KV heads
    num_params: int            # parameters a token runs through (a mixture's active experts only)

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.kv_values_per_token * DTYPE_BYTES.get(dtype, 4)


def config_dir(path_or_name: str | None) -> Path | None:
    """The local directory of the model's config.json, never building or downloading one."""
    from qmigrate.hub.store import SMOLLM2_NAME, cache_root, default_model_dir
    if path_or_name is None:
        return default_model_dir()
    if path_or_name == SMOLLM2_NAME:
        from qmigrate.hub.smollm2 import SMOLLM2_DIR_NAME
        return cache_root() / SMOLLM2_DIR_NAME
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    try:   # a hub name: its cached snapshot, if this machine has one
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(path_or_name, "config.json")
    except Exception:  # noqa: BLE001 -- not a hub name, or no hub package: unknown
        return None
    return Path(found).parent if isinstance(found, str) else None


def _int(config: dict, *names: str, default: int = 0) -> int:
    for name in names:
        value = config.get(name)
        if type(value) is int and value > 0:
            return value
    return default


def migration_costs(path_or_name: str | None) -> MigrationCosts | None:
    """None when the config cannot be read here (then every move recomputes)."""
    directory = config_dir(path_or_name)
    try:
        config = json.loads((directory / "config.json").read_text()) if directory else None
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden, layers = _int(text, "hidden_size"), _int(text, "num_hidden_layers")
    heads = _int(text, "num_attention_heads")
    if not (hidden and layers and heads):
        return None
    kv_heads = _int(text, "num_key_value_heads", default=heads)
    head_dim = _int(text, "head_dim", default=hidden // heads)
    vocab = _int(text, "vocab_size")
    inter = _int(text, "intermediate_size")
    experts = _int(text, "num_experts_per_tok")
    if experts:   # a mixture: the experts a token runs through, and any shared expert
        inter = experts * _int(text, "moe_intermediate_size", default=inter) \
            + _int(text, "shared_expert_intermediate_size")
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attention + 3 * hidden * inter
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)) is True
    num_params = layers * per_layer + vocab * hidden * (1 if tied else 2)
    return MigrationCosts(2 * layers * kv_heads * head_dim, num_params)

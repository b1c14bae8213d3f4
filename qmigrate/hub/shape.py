"""A model's shape as the serving side needs it, read from its transformers config once.

The engine sizes its KV pool and checks lengths with it, a worker tells the router its KV
bytes per token and parameter count from it (the migration cost rule), and a tensor-parallel
worker checks that heads and MLP widths divide by its world size. Multimodal configs keep the
language model's shape in their text config.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

MLP_WIDTH_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def text_config(config):
    """The language model's part of a (possibly multimodal) transformers config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_length(config) -> int:
    """The positions the model was built for; 0 when its config does not say."""
    return int(getattr(text_config(config), "max_position_embeddings", 0) or 0)


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    num_heads: int                  # attention (query) heads
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int                # 0: the config does not say
    mlp_widths: tuple[int, ...]     # every MLP width: dense, each expert's, the shared expert's
    num_params: int = 0             # 0: not counted (a config alone has no weights)

    @classmethod
    def from_config(cls, config, num_params: int = 0) -> "ModelShape":
        text = text_config(config)
        heads = text.num_attention_heads
        widths = {int(w) for w in (getattr(text, name, None) for name in MLP_WIDTH_FIELDS) if w}
        return cls(num_layers=text.num_hidden_layers, num_heads=heads,
                   num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   hidden_size=text.hidden_size, vocab_size=text.vocab_size, max_context=context_length(text),
                   mlp_widths=tuple(sorted(widths)), num_params=num_params)

    @classmethod
    def of_model(cls, model) -> "ModelShape":
        """The shape of a loaded model, its parameters counted (meta tensors count too). Its
        vocabulary is the smaller of the config's and the embedding's rows: an id past the
        embedding is a device-side assert on a GPU, so no id the engine accepts or makes up
        may reach it."""
        shape = cls.from_config(model.config, num_params=sum(p.numel() for p in model.parameters()))
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        rows = getattr(embed, "num_embeddings", None)
        return dataclasses.replace(shape, vocab_size=min(shape.vocab_size, rows)) if rows else shape

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV bytes of one token over every layer and KV head (what a transfer ships)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

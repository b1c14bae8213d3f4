"""Built-in models, built offline from a fixed seed: a tiny test model and the benchmark model
(random weights with TinyLlama-1.1B's shape), each with a tokenizer trained on a small corpus."""

from __future__ import annotations

import json
import os
import random
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from qmigrate.hub.store import DEFAULT_MODEL_NAME, build_atomically, parse_dtype

if TYPE_CHECKING:
    import torch

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = [UNK, BOS, EOS]  # ids 0, 1, 2

TINY_VOCAB_SIZE = 1500
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
)
# With the usual std of 0.02 a model this small is nearly linear in its input and greedy
# decoding locks onto one token; a large std gives sharp, input-dependent logits.
TINY_INIT_STD = 0.5

BENCH_VOCAB_SIZE = 32000
BENCH_SHAPE = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
)
BENCH_INIT_STD = 0.02

# The mixture-of-experts benchmark model: Mixtral's layout, 8 experts of which 2 run per
# token, about 1.4B parameters of which about 0.45B are read per token.
BENCH_MOE_SHAPE = dict(
    hidden_size=2048, intermediate_size=1408, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
    num_local_experts=8, num_experts_per_tok=2,
)


# ---------------------------------------------------------------- corpus and tokenizer

_SUBJECTS = """the old sailor|a small robot|my neighbour|the committee|every student|the river
|a quiet engineer|the northern wind|our little cat|the night train|a tired doctor|the city council
|the orchestra|a curious child|the ancient library|the baker down the street|this algorithm
|the last lighthouse keeper|a flock of geese|the weather station""".split("|")
_VERBS = """carried|forgot|painted|measured|discovered|repaired|described|followed|borrowed
|questioned|celebrated|ignored|translated|compressed|scheduled|migrated|counted|whispered to
|built|explained""".split("|")
_OBJECTS = """a broken umbrella|the morning newspaper|seven blue bottles|the final report
|a map of the harbour|an unfinished letter|the village bridge|two hundred apples|the server logs
|a recipe for bread|the tallest mountain|a lost key|the yearly budget|a strange melody
|the kernel patch|forty kilometres of road|the garden fence|a box of old photographs""".split("|")
_ADVERBS = """slowly|carefully|yesterday|before dawn|without a word|at noon|with great care
|in the rain|once again|for no reason|by accident|after the meeting|quite happily
|in silence|every Tuesday""".split("|")
_CONNECTIVES = ["and then", "because", "although", "while", "so", "but", "until", "after"]
_QUESTIONS = ["Why", "How", "When", "Where", "Who", "What"]
_MULTILINGUAL = [
    "Le café crème était déjà froid quand l'élève arriva à l'école.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein, sagte der Bäcker aus Köln.",
    "El niño pidió una canción más antes de dormir; mañana será otro día.",
    "São Paulo é a maior cidade do Brasil, e a população não pára de crescer.",
    "Smörgåsbord, fjärilar och små röda hus längs vägen till Göteborg.",
    "Zażółć gęślą jaźń — to zdanie zawiera wszystkie polskie litery.",
    "Ελληνικά γράμματα: άλφα, βήτα, γάμμα, δέλτα.",
    "Привет, мир! Сегодня хорошая погода для прогулки.",
    "我们明天早上八点在火车站见面，然后一起去图书馆。",
    "机器学习模型在多个图形处理器之间迁移请求。",
    "東京の天気は晴れです。今日は新しいプログラムを書きました。",
    "ひらがなとカタカナと漢字を混ぜて書くのは楽しいです。",
    "안녕하세요, 오늘은 날씨가 정말 좋네요.",
    "مرحبا بالعالم، هذه جملة باللغة العربية.",
    "नमस्ते दुनिया, यह एक हिंदी वाक्य है।",
    "Emoji time 😀🎉🚀 and a heart ❤️ with a flag 🇯🇵 and a family 👨‍👩‍👧.",
    "Weather: ☀️ then 🌧️ then ⛈️, temperature −3 °C to 12 °C, price €4.50 or £3.99.",
    "Math: ∑ xᵢ² ≤ ∞, α + β = γ, √2 ≈ 1.414, π ≈ 3.14159.",
]


def _corpus(num_lines: int = 400) -> list[str]:
    r = random.Random(20240611)
    lines = []
    for i in range(num_lines):
        kind = i % 5
        s, v, o, a = r.choice(_SUBJECTS), r.choice(_VERBS), r.choice(_OBJECTS), r.choice(_ADVERBS)
        if kind == 0:
            line = f"{s.capitalize()} {v} {o} {a}."
        elif kind == 1:
            s2, v2, o2 = r.choice(_SUBJECTS), r.choice(_VERBS), r.choice(_OBJECTS)
            line = f"{s.capitalize()} {v} {o}, {r.choice(_CONNECTIVES)} {s2} {v2} {o2}."
        elif kind == 2:
            line = f"{r.choice(_QUESTIONS)} did {s} say that {o} was {a}?"
        elif kind == 3:
            n, m = r.randint(2, 9999), r.randint(1, 99)
            line = f"Item {n}: {o} costs ${m}.{r.randint(0, 99):02d} ({n * m} in total)."
        else:
            name = re.sub(r"\W+", "_", o).strip("_")
            line = f"def {name}(x, n={r.randint(1, 64)}):\n    return [x * i for i in range(n)]"
        lines.append(line)
    return lines + _MULTILINGUAL * 3


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return _finish(tok)


def _finish(tok: Tokenizer) -> Tokenizer:
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return tok


def _pad_tokenizer(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Grow a trained BPE to exactly vocab_size with filler merges of existing tokens."""
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = dict(state["model"]["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["model"]["merges"]]
    parts = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in SPECIAL_TOKENS]
    for a in parts:
        for b in parts:
            if len(vocab) >= vocab_size:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    padded = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK))
    padded.pre_tokenizer = tok.pre_tokenizer
    padded.decoder = tok.decoder
    for t in SPECIAL_TOKENS:
        padded.add_special_tokens([t])
    return _finish(padded)


def _save_tokenizer(tok: Tokenizer, out_dir: Path, max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=EOS,
        model_max_length=max_length,
    )
    hf_tok.save_pretrained(out_dir)


def _llama_config(vocab_size: int, shape: dict, dtype: torch.dtype, init_std: float):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        initializer_range=init_std, **shape,
    )
    config.dtype = dtype
    config.architectures = ["LlamaForCausalLM"]
    return config


def _random_state_dict(config, seed: int, dtype: torch.dtype, std: float) -> dict[str, torch.Tensor]:
    """Weights ~ N(0, std), norms = 1; each tensor seeded by (seed, name) so tensors fill in parallel."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}

    def fill(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], dtype=dtype)
        # the CPU generator keeps only 32 bits of its seed, so mix seed and name into 32
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
        return torch.empty(shapes[name]).normal_(0.0, std, generator=gen).to(dtype)

    names = sorted(shapes)
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(fill, names)))


def _save_model(config, state: dict[str, torch.Tensor], out_dir: Path) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.eos_token_id,
    ).save_pretrained(out_dir)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})


def build_tiny_model(out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    identity = {"builder": DEFAULT_MODEL_NAME, "seed": seed}

    def write(tmp: Path) -> None:
        tok = _train_tokenizer(TINY_VOCAB_SIZE)
        dtype = parse_dtype("float32")
        config = _llama_config(tok.get_vocab_size(), TINY_SHAPE, dtype, TINY_INIT_STD)
        _save_model(config, _random_state_dict(config, seed, dtype, TINY_INIT_STD), tmp)
        _save_tokenizer(tok, tmp, TINY_SHAPE["max_position_embeddings"])

    return build_atomically(out_dir, identity, write)


def build_bench_model(
    out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "bfloat16",
    shape_overrides: dict | None = None,
) -> Path:
    shape = {**BENCH_SHAPE, **(shape_overrides or {})}
    vocab_size = shape.pop("vocab_size", BENCH_VOCAB_SIZE)
    torch_dtype = parse_dtype(dtype)
    identity = {"builder": "bench-llama-1.1b-shape", "seed": seed, "dtype": str(torch_dtype),
                "shape": shape, "vocab_size": vocab_size}

    def write(tmp: Path) -> None:
        tok = _pad_tokenizer(_train_tokenizer(min(vocab_size, TINY_VOCAB_SIZE)), vocab_size)
        config = _llama_config(vocab_size, shape, torch_dtype, BENCH_INIT_STD)
        _save_model(config, _random_state_dict(config, seed, torch_dtype, BENCH_INIT_STD), tmp)
        _save_tokenizer(tok, tmp, shape["max_position_embeddings"])

    return build_atomically(out_dir, identity, write)


def build_bench_moe_model(
    out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "bfloat16",
    shape_overrides: dict | None = None,
) -> Path:
    """The MoE benchmark model (BENCH_MOE_SHAPE, Mixtral's layout), random weights."""
    from transformers import MixtralConfig

    shape = {**BENCH_MOE_SHAPE, **(shape_overrides or {})}
    vocab_size = shape.pop("vocab_size", BENCH_VOCAB_SIZE)
    torch_dtype = parse_dtype(dtype)
    identity = {"builder": "bench-moe-mixtral-8x2", "seed": seed, "dtype": str(torch_dtype),
                "shape": shape, "vocab_size": vocab_size}

    def write(tmp: Path) -> None:
        tok = _pad_tokenizer(_train_tokenizer(min(vocab_size, TINY_VOCAB_SIZE)), vocab_size)
        config = MixtralConfig(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                               initializer_range=BENCH_INIT_STD, sliding_window=None, **shape)
        config.dtype = torch_dtype
        config.architectures = ["MixtralForCausalLM"]
        _save_model(config, _random_state_dict(config, seed, torch_dtype, BENCH_INIT_STD), tmp)
        _save_tokenizer(tok, tmp, shape["max_position_embeddings"])

    return build_atomically(out_dir, identity, write)

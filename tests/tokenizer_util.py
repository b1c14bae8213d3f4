"""Small tokenizers built offline, for tests that need a real tokenizer.

`build_tokenizer`: byte-level BPE (GPT-2 style). `build_sentencepiece_tokenizer`: Llama
style, "▁" word marks with <0xNN> byte fallback and the first leading space stripped on
decode. Both are trained on built-in text (ASCII, accents, CJK, emoji) with small
vocabularies, so rare characters are split across several byte tokens, and both go
through save_pretrained and AutoTokenizer.from_pretrained, the loading path of a model.
"""

from __future__ import annotations

import functools
import json
import tempfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A request is a sequence of token ids; each decode step is a unit of work.",
    "Work moves between GPUs step by step, so a fleet of unequal GPUs stays balanced.",
    "The router keeps the id queue and leases batches to workers.",
    "Every generated token has an index and is printed exactly once.",
    "Greedy output equals the reference generate() for that prompt alone.",
    "Once upon a time there was a small model that told short stories.",
    "She said: \"hello, world!\" and then (quietly) left the room.",
    "Numbers like 3.14159, 42 and 1000000 appear in text too.",
    "Café, naïve, résumé, façade, jalapeño, Ærø, Zürich, São Paulo.",
    "Über die Brücke gehen wir später, sagte der Bär.",
    "El niño comió piña en la mañana.",
    "東京は日本の首都です。",
    "我喜欢学习新的语言。",
    "今日はいい天気ですね。",
    "한국어도 조금 있습니다.",
    "Emoji: 🙂 👍 🚀 🎉 ❤️ are common in chat.",
    "Tabs\tand\nnewlines\nshould round trip.",
]


def _corpus() -> list[str]:
    lines = []
    for i in range(20):
        for j, sentence in enumerate(_SENTENCES):
            lines.append(f"{sentence} {i * len(_SENTENCES) + j}")
    return lines


@functools.lru_cache(maxsize=1)
def build_tokenizer() -> PreTrainedTokenizerFast:
    """Return the shared test tokenizer (bos `<s>` added to prompts, eos `</s>`)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return _load(tok)


@functools.lru_cache(maxsize=1)
def build_sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-style test tokenizer (bos `<s>` added to prompts, eos `</s>`)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    # Trained without CJK and emoji so that those fall back to byte tokens.
    tok.train_from_iterator(
        [line for line in _corpus() if all(ord(c) < 0x2000 for c in line)], trainer
    )
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return _load(tok)


def _load(tok: Tokenizer) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        wrapped.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)

"""Incremental detokenization (pure: no zmq): `IncrementalDecoder` turns one request's
token stream into text deltas. The output sinks that print them are in sinks.py."""

from __future__ import annotations

from collections.abc import Sequence

try:
    from tokenizers.decoders import DecodeStream
except ImportError:   # tokenizers before 0.21
    DecodeStream = None

REPLACEMENT = "\ufffd"
NUM_PRIME_IDS = 5


class IncrementalDecoder:
    """Text deltas for one token stream, by the prefix/read offset method.

    Each push decodes the window ids[prefix_offset:] and emits the text past
    decode(ids[prefix_offset:read_offset]), which was emitted already. Text ending in an
    incomplete UTF-8 character (U+FFFD) is held back until a later token completes it.
    Decoding skips special tokens and never cleans up spaces, because clean-up looks across
    window edges; deltas + finish() equal decode(generated_ids, skip_special_tokens=True,
    clean_up_tokenization_spaces=False), except that when primed on the prompt a
    sentencepiece tokenizer keeps the first token's leading space, as a full decode of
    prompt + generated does.

    With a fast tokenizer the pushes go through the `tokenizers` library's `DecodeStream`,
    which runs the same method in Rust (2.3-2.5 us a token against 7.1-7.3 us for two
    `decode` calls from Python); the offsets are kept here as well, for `finish`.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] | None = None, *, use_stream: bool = True) -> None:
        self._tokenizer = tokenizer
        # A model's vocabulary may be larger than its tokenizer's (Qwen2: 151,936 against
        # 151,665): an id past the tokenizer is valid output and decodes as no text.
        self._vocab_size = len(tokenizer)
        self._ids = self._prime_ids([] if prompt_ids is None else [int(t) for t in prompt_ids
                                                                   if int(t) < self._vocab_size])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if use_stream else None
        self._stream = None
        if DecodeStream is not None and self._backend is not None:
            try:
                self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=True)
            except TypeError:   # before tokenizers 0.22 a stream could not start on the prompt
                self._stream = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _prime_ids(self, prompt_ids: list[int]) -> list[int]:
        # The prompt's tail gives the first generated token the context a full decode has
        # (e.g. a sentencepiece leading space). The window must start and end on whole
        # characters, or the first delta would repeat or mangle prompt bytes.
        if not prompt_ids:
            return []
        start = max(0, len(prompt_ids) - NUM_PRIME_IDS)
        min_start = max(0, start - 3)  # a character is at most 4 bytes, so 3 ids back
        while start > min_start and self._decode(prompt_ids[start:]).startswith(REPLACEMENT):
            start -= 1
        tail = prompt_ids[start:]
        text = self._decode(tail)
        if text.startswith(REPLACEMENT) or text.endswith(REPLACEMENT):
            return []
        return tail

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly printable text (may be "")."""
        vocab_size = self._vocab_size
        token_ids = [t for t in map(int, token_ids) if t < vocab_size]  # int32 arrays come off the wire
        if not token_ids:
            return ""
        if self._stream is not None:
            return self._push_stream(token_ids)
        return "".join([self._push_one(t) for t in token_ids])

    def _push_one(self, token: int) -> str:
        """push() of one id from Python: several ids pushed at once give what pushing them
        one by one gives, as through the stream."""
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _push_stream(self, token_ids: list[int]) -> str:
        """push() through the Rust stream, one id at a time (its offsets move as ours would)."""
        out = []
        for i, token in enumerate(token_ids):
            try:
                text = self._stream.step(self._backend, token)
            except Exception:   # the longer window no longer starts with the text emitted
                # (byte-fallback ids that join into other characters): the Rust stream gives
                # up there; the Python method emits past the same length, so it goes on
                self._stream = None
                return "".join(out + [self._push_one(t) for t in token_ids[i:]])
            self._ids.append(token)
            if text:
                out.append(text)
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return "".join(out)

    def finish(self) -> str:
        """Return whatever was held back (an incomplete character prints as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

"""Prompt parsing and validation for the ingest role (pure: no zmq).

Text input: one prompt per line, the line as typed (only its line ending is removed); the
request id is the 1-based line number.

JSONL input: one object per line with the keys
    id              string or integer (default: the line number)
    prompt          text, tokenized with the tokenizer's special tokens (BOS if it adds one)
    prompt_ids      non-empty list of token ids, taken as given
    max_new_tokens  integer >= 1
    temperature     number >= 0 (0 is greedy)
    top_p           number in (0, 1]
    top_k           integer >= 0 (0 is off)
    seed            integer in [0, 2**63)
    stop            a string, or a list of strings and/or lists of token ids
Exactly one of prompt / prompt_ids. A key given as null takes its default. Stop strings are
tokenized alone, without special tokens, so a stop string matches only when the model
generates that exact token sequence.

Every problem raises PromptError with a message meant for the user and the request id.
A prompt that leaves no room for one new token is an error; a max_new_tokens that does
not fit the context is clamped to what fits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

MAX_SEED = 2**63
KEYS = frozenset(
    ["id", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_p", "top_k",
     "seed", "stop"]
)


@dataclass(slots=True)
class Prompt:
    req_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_ids: list[list[int]]


@dataclass(slots=True, frozen=True)
class Defaults:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


class PromptError(ValueError):
    """A request that cannot be served; `req_id` names it for the error record."""

    def __init__(self, req_id: str, message: str) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.message = message


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_line(
    line: str,
    *,
    mode: Literal["text", "jsonl"],
    line_no: int,
    tokenizer,
    max_context: int,
    defaults: Defaults = Defaults(),
    eos_ids: Collection[int] = (),
    vocab_size: int | None = None,
) -> Prompt:
    """Parse one input line into a validated Prompt, or raise PromptError.

    `vocab_size` bounds prompt_ids and stop ids (default: len(tokenizer)). `eos_ids`: a
    tokenizer that appends EOS to encoded text would make the model see the text as
    finished, so a trailing EOS is removed from tokenized prompts.
    """
    line = line.removesuffix("\n").removesuffix("\r")
    req_id = str(line_no)
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if mode == "text":
        if not line.strip():
            raise PromptError(req_id, "empty prompt")
        prompt_ids = _encode_prompt(line, tokenizer, eos_ids)
        return _fit(Prompt(req_id, prompt_ids, defaults.max_new_tokens, defaults.temperature,
                           defaults.top_p, defaults.top_k, None, []), max_context)
    if mode != "jsonl":
        raise ValueError(f"unknown input mode {mode!r}; expected 'text' or 'jsonl'")

    if not line.strip():
        raise PromptError(req_id, "empty line")
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except ValueError as exc:
        raise PromptError(req_id, f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise PromptError(req_id, f"expected a JSON object, got {type(obj).__name__}")

    raw_id = obj.get("id")
    if raw_id is not None:
        if isinstance(raw_id, str) and raw_id:
            req_id = raw_id
        elif _is_int(raw_id):
            req_id = str(raw_id)
        else:
            raise PromptError(req_id, "id must be a non-empty string or an integer")

    def fail(message: str):
        raise PromptError(req_id, message)

    unknown = sorted(set(obj) - KEYS)
    if unknown:
        fail(f"unknown key {unknown[0]!r}")
    obj = {key: value for key, value in obj.items() if value is not None}

    if ("prompt" in obj) == ("prompt_ids" in obj):
        fail("give exactly one of 'prompt' and 'prompt_ids'")
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str):
            fail("prompt must be a string")
        if not text.strip():
            fail("empty prompt")
        prompt_ids = _encode_prompt(text, tokenizer, eos_ids)
    else:
        prompt_ids = _check_ids(obj["prompt_ids"], "prompt_ids", vocab_size, fail)

    max_new_tokens = obj.get("max_new_tokens", defaults.max_new_tokens)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        fail("max_new_tokens must be an integer >= 1")
    temperature = obj.get("temperature", defaults.temperature)
    if not _is_number(temperature) or temperature < 0:
        fail("temperature must be a number >= 0")
    top_p = obj.get("top_p", defaults.top_p)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        fail("top_p must be a number in (0, 1]")
    top_k = obj.get("top_k", defaults.top_k)
    if not _is_int(top_k) or top_k < 0:
        fail("top_k must be an integer >= 0")
    seed = obj.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < MAX_SEED):
        fail("seed must be an integer in [0, 2**63)")
    stop_ids = _parse_stop(obj.get("stop", []), tokenizer, vocab_size, fail)

    return _fit(Prompt(req_id, prompt_ids, max_new_tokens, float(temperature), float(top_p),
                       top_k, seed, stop_ids), max_context)


def _encode_prompt(text: str, tokenizer, eos_ids: Collection[int]) -> list[int]:
    ids = list(tokenizer.encode(text))
    if len(ids) > 1 and ids[-1] in eos_ids:
        ids.pop()
    return ids


def _check_ids(value, name: str, vocab_size: int, fail) -> list[int]:
    if not isinstance(value, list) or not value:
        fail(f"{name} must be a non-empty list of token ids")
    for i, token_id in enumerate(value):
        if not _is_int(token_id):
            fail(f"{name}[{i}] must be an integer token id, got {json.dumps(token_id)}")
        if not 0 <= token_id < vocab_size:
            fail(f"{name}[{i}] = {token_id} is out of range [0, {vocab_size})")
    return list(value)


def _parse_stop(value, tokenizer, vocab_size: int, fail) -> list[list[int]]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        fail("stop must be a string or a list of strings and token id lists")
    stop_ids = []
    for i, item in enumerate(items):
        name = "stop" if isinstance(value, str) else f"stop[{i}]"
        if isinstance(item, str):
            if not item:
                fail(f"{name} is an empty string")
            stop_ids.append(list(tokenizer.encode(item, add_special_tokens=False)))
        elif isinstance(item, list):
            stop_ids.append(_check_ids(item, name, vocab_size, fail))
        else:
            fail(f"{name} must be a string or a list of token ids")
    return stop_ids


def _fit(prompt: Prompt, max_context: int) -> Prompt:
    num_prompt = len(prompt.prompt_ids)
    if num_prompt + 1 > max_context:
        raise PromptError(
            prompt.req_id,
            f"prompt is {num_prompt} tokens; the model's context is {max_context}",
        )
    prompt.max_new_tokens = min(prompt.max_new_tokens, max_context - num_prompt)
    return prompt

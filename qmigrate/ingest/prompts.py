"""Prompt parsing and validation for the ingest role (pure: no zmq).

Text input: one prompt per line, the line as typed (only its line ending is removed); the
request id is the 1-based line number. With `chat`, each line is one user message, put
through the model's chat template.

JSONL input: one object per line with the keys
    id              string or integer (default: the line number)
    prompt          text, tokenized with the tokenizer's special tokens (BOS if it adds one)
    messages        chat: a non-empty list of {"role", "content"} objects, put through the
                    model's chat template (with the assistant's turn opened)
    prompt_ids      non-empty list of token ids, taken as given
    max_new_tokens  integer >= 1
    temperature     number from 0 to 2 (0 is greedy), as over HTTP
    top_p           number in (0, 1]
    top_k           integer from 0 (off) to 2**30
    seed            integer in [0, 2**63)
    stop            a string, or a list of strings and/or lists of token ids (at most 64,
                    each at most 64 tokens)
    ignore_eos      boolean: generate past EOS (stop sequences still apply)
    min_tokens      integer from 0 to max_new_tokens: neither EOS nor a stop ends it sooner
                    (EOS and stop_token_ids cannot be sampled before)
    presence_penalty, frequency_penalty
                    numbers from -2 to 2 (OpenAI's definitions; engine/controls.py)
    repetition_penalty  number from 0.01 to 100, 1 is off (transformers' definition)
    min_p           number from 0 to 1: drop tokens less likely than min_p times the likeliest
    logit_bias      {"token id": bias from -100 to 100}, at most 1024 entries
    stop_token_ids  list of token ids that end the output as EOS does (with EOS, at most 64)
    logprobs        integer from 0 to 20: each generated token's logprob and that many likeliest
                    alternatives' (vLLM's; the final record's "logprobs")
    prompt_logprobs integer from 0 to 20: the same for each prompt token after the first
    return_token_ids  boolean, HTTP's (vLLM's); the final record carries "token_ids" either way
    response_format, structured_outputs
                    structured output as over HTTP (docs/http.md) (OpenAI's {"type": "json_object"} or
                    {"type": "json_schema", "json_schema": {"schema", "strict"}}; vLLM's {"json" |
                    "regex" | "choice" | "grammar": ...}): the output follows the grammar
Exactly one of prompt / prompt_ids / messages. A line {"cancel": ID} (and nothing else)
asks to cancel the running request ID. A key given as null takes its default. Stop strings are
tokenized alone, without special tokens, so a stop string matches only when the model
generates that exact token sequence.

Every problem raises PromptError with a message meant for the user, the request id, and the
field at fault (named in quotes in the message, as the HTTP API's errors do).
A prompt that leaves no room for one new token is an error; a max_new_tokens that does
not fit the context is clamped to what fits. The bounds are the wire's (wire/limits.py), and a
request that passes here is checked once more as the router will decode it (`check_prompt`),
so what ingest accepts the router accepts. Strings must be encodable (no lone surrogates)
and JSON at most MAX_JSON_DEPTH deep.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from qmigrate.ingest.chat import check_chars, encode_chat
from qmigrate.ingest.json_checks import (
    MAX_JSON_DEPTH, check_json, is_int, is_int_list, is_number, readable_id, reject_constant,
)
from qmigrate.wire import protocol as P
from qmigrate.wire import codec

MAX_SEED = P.MAX_SEED + 1  # exclusive: seeds are in [0, 2**63)
KEYS = frozenset(
    ["id", "prompt", "prompt_ids", "messages", "max_new_tokens", "temperature", "top_p",
     "top_k", "seed", "stop", "ignore_eos", "min_tokens", "cache_salt", "presence_penalty",
     "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "stop_token_ids", "logprobs",
     "prompt_logprobs", "response_format", "structured_outputs", "tools", "return_token_ids"]
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
    note: str = ""            # said in the request's final record (a clamped max_new_tokens)
    ignore_eos: bool = False  # run on past EOS (synthetic loads of exact lengths)
    min_tokens: int = 0       # neither EOS nor a stop sequence ends it before this many tokens
    cache_salt: str = ""      # shares cached prompt prefixes only with requests of the same salt
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)   # end the output as EOS does
    num_logprobs: int = -1          # >= 0: each token's logprob with this many alternatives
    num_prompt_logprobs: int = -1   # >= 0: the prompt's too
    grammar: str = ""         # structured output: a grammar text (hub/grammars.py); "" none
    return_token_ids: bool = False   # HTTP: its reply carries the prompt's and the output's ids


@dataclass(slots=True, frozen=True)
class Defaults:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    structured_output_compile_timeout_s: float = 5.0


@dataclass(slots=True, frozen=True)
class CancelRequest:
    req_id: str


class PromptError(ValueError):
    """A request that cannot be served; `req_id` names it for the error record, `param` the
    request's field at fault (None: the request as a whole)."""

    def __init__(self, req_id: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.message = message
        self.param = param


def to_spec(prompt: Prompt, seq_id: int, seed: int, eos_ids: Collection[int]) -> P.SeqSpec:
    """The request's full form as the router and the workers take it."""
    ends = set(prompt.stop_token_ids) if prompt.ignore_eos else set(eos_ids).union(prompt.stop_token_ids)
    return P.SeqSpec(seq_id, P.pack_i32(prompt.prompt_ids), len(prompt.prompt_ids), prompt.max_new_tokens,
                     prompt.temperature, prompt.top_p, prompt.top_k, seed, prompt.stop_ids,
                     sorted(ends), min_new_tokens=prompt.min_tokens,
                     cache_salt=prompt.cache_salt, presence_penalty=prompt.presence_penalty,
                     frequency_penalty=prompt.frequency_penalty, repetition_penalty=prompt.repetition_penalty,
                     min_p=prompt.min_p, bias_ids=list(prompt.logit_bias),
                     bias_values=list(prompt.logit_bias.values()), num_logprobs=prompt.num_logprobs,
                     num_prompt_logprobs=prompt.num_prompt_logprobs, grammar=prompt.grammar)


def seed_of(prompt: Prompt, rng) -> int:
    """The request's seed, or one drawn for it: the same draw wherever the spec is made (the
    ingest loop, or an HTTP front process), so that an unseeded request samples alike."""
    return prompt.seed if prompt.seed is not None else rng.randrange(1 << 62)


def check_prompt(prompt: Prompt, eos_ids: Collection[int] = ()) -> Prompt:
    """Raise PromptError unless the router would decode this request: the codec's own check."""
    spec = to_spec(prompt, 1, prompt.seed if prompt.seed is not None else 0, eos_ids)
    try:
        codec.check_wire(P.Submit([spec], [prompt.req_id], [], -1, P.pack_u8([P.ROUTE_INGEST]), [prompt.note]))
    except P.ProtocolError as exc:
        raise PromptError(prompt.req_id, f"the request is past the protocol's bounds: {exc}") from None
    return prompt


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
    chat: bool = False,
) -> Prompt | CancelRequest:
    """Parse one input line into a validated Prompt (or a CancelRequest), or raise PromptError.

    `vocab_size` bounds prompt_ids and stop ids (default: len(tokenizer)). `eos_ids`: a
    tokenizer that appends EOS to encoded text would make the model see the text as
    finished, so a trailing EOS is removed from tokenized prompts.
    """
    line = line.removesuffix("\n").removesuffix("\r")
    req_id = str(line_no)
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if mode == "text":
        try:
            check_json(line)
        except ValueError as exc:
            raise PromptError(req_id, str(exc)) from None
        if not line.strip():
            raise PromptError(req_id, "empty prompt")
        check_chars(len(line), tokenizer, max_context, lambda m: _raise(req_id, m))
        if chat:
            prompt_ids = encode_chat([{"role": "user", "content": line}], tokenizer, lambda m: _raise(req_id, m))
        else:
            prompt_ids = _encode_prompt(line, tokenizer, eos_ids)
        return check_prompt(_fit(Prompt(req_id, prompt_ids, defaults.max_new_tokens, defaults.temperature,
                                        defaults.top_p, defaults.top_k, None, []), max_context), eos_ids)
    if mode != "jsonl":
        raise ValueError(f"unknown input mode {mode!r}; expected 'text' or 'jsonl'")

    if not line.strip():
        raise PromptError(req_id, "empty line")
    try:
        obj = json.loads(line, parse_constant=reject_constant)
        check_json(obj)
    except ValueError as exc:
        raise PromptError(readable_id(line) or req_id, f"invalid JSON: {exc}") from None
    except RecursionError:
        raise PromptError(readable_id(line) or req_id,
                          f"invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(obj, dict):
        raise PromptError(req_id, f"expected a JSON object, got {type(obj).__name__}")

    if set(obj) == {"cancel"}:
        target = obj["cancel"]
        if is_int(target) or (isinstance(target, str) and target):
            return CancelRequest(str(target))
        raise PromptError(req_id, "'cancel' must name a request id (a non-empty string or an integer)", "cancel")
    raw_id = obj.get("id")
    if raw_id is not None:
        if isinstance(raw_id, str) and raw_id:
            if len(raw_id) > P.MAX_REQ_ID:
                raise PromptError(req_id, f"'id' is longer than {P.MAX_REQ_ID} characters", "id")
            req_id = raw_id
        elif is_int(raw_id):
            req_id = str(raw_id)
        else:
            raise PromptError(req_id, "'id' must be a non-empty string or an integer", "id")
    return parse_request(obj, req_id, tokenizer=tokenizer, max_context=max_context,
                         defaults=defaults, eos_ids=eos_ids, vocab_size=vocab_size)


def parse_request(
    obj: dict,
    req_id: str,
    *,
    tokenizer,
    max_context: int,
    defaults: Defaults = Defaults(),
    eos_ids: Collection[int] = (),
    vocab_size: int | None = None,
) -> Prompt:
    """Validate one decoded request object (the JSONL keys above, without "id")."""
    if vocab_size is None:
        vocab_size = len(tokenizer)

    def fail(message: str, param: str | None = None):
        raise PromptError(req_id, message, param)

    try:
        check_json(obj)
    except ValueError as exc:
        fail(str(exc))
    unknown = sorted(set(obj) - KEYS)
    if unknown:
        fail(f"'{unknown[0]}' is an unrecognized request argument", unknown[0])
    obj = {key: value for key, value in obj.items() if value is not None}

    if sum(key in obj for key in ("prompt", "prompt_ids", "messages")) != 1:
        fail("give exactly one of 'prompt', 'prompt_ids' and 'messages'")
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str):
            fail("'prompt' must be a string", "prompt")
        if not text.strip():
            fail("'prompt' is empty", "prompt")
        check_chars(len(text), tokenizer, max_context, lambda message: fail(message, "prompt"))
        prompt_ids = _encode_prompt(text, tokenizer, eos_ids)
    elif "messages" in obj:
        tools = obj.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            fail("'tools' must be a list of tool objects", "tools")
        prompt_ids = encode_chat(obj["messages"], tokenizer, lambda message: fail(message, "messages"),
                                 max_context=max_context, tools=tools)
    else:
        prompt_ids = _check_ids(obj["prompt_ids"], "prompt_ids", vocab_size, fail)

    max_new_tokens = obj.get("max_new_tokens", defaults.max_new_tokens)
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        fail("'max_new_tokens' must be an integer >= 1", "max_new_tokens")
    temperature = obj.get("temperature", defaults.temperature)
    if not is_number(temperature) or not 0 <= temperature <= P.MAX_TEMPERATURE:
        fail(f"'temperature' must be a number from 0 to {P.MAX_TEMPERATURE:g}", "temperature")
    top_p = obj.get("top_p", defaults.top_p)
    if not is_number(top_p) or not 0 < top_p <= 1:
        fail("'top_p' must be a number in (0, 1]", "top_p")
    top_k = obj.get("top_k", defaults.top_k)
    if not is_int(top_k) or not 0 <= top_k <= P.MAX_TOP_K:
        fail(f"'top_k' must be an integer from 0 (off) to {P.MAX_TOP_K}", "top_k")
    seed = obj.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed < MAX_SEED):
        fail("'seed' must be an integer in [0, 2**63)", "seed")
    stop_ids = _parse_stop(obj.get("stop", []), tokenizer, vocab_size, fail)
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        fail("'ignore_eos' must be a boolean", "ignore_eos")
    min_tokens = obj.get("min_tokens", 0)
    if not is_int(min_tokens) or not 0 <= min_tokens <= max_new_tokens:
        fail(f"'min_tokens' must be an integer from 0 to 'max_new_tokens' ({max_new_tokens})",
             "min_tokens")
    cache_salt = obj.get("cache_salt", "")
    if not isinstance(cache_salt, str) or len(cache_salt) > P.MAX_CACHE_SALT:
        fail(f"'cache_salt' must be a string of at most {P.MAX_CACHE_SALT} characters", "cache_salt")

    penalties = {}
    for name, low, high in (("presence_penalty", -P.MAX_PENALTY, P.MAX_PENALTY),
                            ("frequency_penalty", -P.MAX_PENALTY, P.MAX_PENALTY),
                            ("repetition_penalty", P.MIN_REPETITION_PENALTY, P.MAX_REPETITION_PENALTY),
                            ("min_p", 0, 1)):
        value = obj.get(name, 1.0 if name == "repetition_penalty" else 0.0)
        if not is_number(value) or not low <= value <= high:
            fail(f"'{name}' must be a number from {low:g} to {high:g}", name)
        penalties[name] = float(value)
    logit_bias = _parse_logit_bias(obj.get("logit_bias", {}), vocab_size, fail)
    stop_token_ids = _check_ids(obj["stop_token_ids"], "stop_token_ids", vocab_size, fail) \
        if obj.get("stop_token_ids") else []
    if len(set(stop_token_ids) | set(eos_ids)) > P.MAX_STOP_LEN:
        fail(f"'stop_token_ids' holds at most {P.MAX_STOP_LEN - len(set(eos_ids))} ids beside the model's EOS",
             "stop_token_ids")

    logprobs = {}
    for name in ("logprobs", "prompt_logprobs"):
        value = obj.get(name, -1)
        if value != -1 and (not is_int(value) or not 0 <= value <= P.MAX_LOGPROBS):
            fail(f"'{name}' must be an integer from 0 to {P.MAX_LOGPROBS}", name)
        logprobs[f"num_{name}"] = value
    return_ids = obj.get("return_token_ids", False)
    if not isinstance(return_ids, bool):
        fail("'return_token_ids' must be a boolean", "return_token_ids")
    grammar = _parse_grammar(obj, fail)
    if grammar and ignore_eos:
        fail("'ignore_eos' cannot be combined with structured output: the grammar's end is an EOS", "ignore_eos")
    if grammar and min_tokens:
        fail("'min_tokens' cannot be combined with structured output: the grammar decides the length",
             "min_tokens")

    prompt = _fit(Prompt(req_id, prompt_ids, max_new_tokens, float(temperature), float(top_p),
                         top_k, seed, stop_ids, ignore_eos=ignore_eos, min_tokens=min_tokens,
                         cache_salt=cache_salt, logit_bias=logit_bias, stop_token_ids=stop_token_ids,
                         grammar=grammar, return_token_ids=return_ids, **penalties, **logprobs), max_context)
    prompt.min_tokens = min(prompt.min_tokens, prompt.max_new_tokens)  # after a clamp to the context
    return check_prompt(prompt, eos_ids)


def _parse_grammar(obj: dict, fail) -> str:
    """The request's structured output as a grammar text ("" for none), its syntax checked
    (compiling it against the tokenizer, which takes time, is `grammars.Compiler`'s)."""
    from qmigrate.hub import grammars
    if "response_format" in obj and "structured_outputs" in obj:
        fail("give one of 'response_format' and 'structured_outputs'", "structured_outputs")
    try:
        if "structured_outputs" in obj:
            grammar, param = grammars.from_structured_outputs(obj["structured_outputs"])
        elif "response_format" in obj:
            grammar, param = grammars.from_response_format(obj["response_format"])
        else:
            return ""
        if grammar:
            grammars.check_size(grammar, param)
            grammars.check_syntax(grammar, param)
    except grammars.GrammarError as exc:
        fail(str(exc), exc.param)
    return grammar


def _raise(req_id: str, message: str, param: str | None = None):
    raise PromptError(req_id, message, param)


def _encode_prompt(text: str, tokenizer, eos_ids: Collection[int]) -> list[int]:
    ids = list(tokenizer.encode(text))
    if len(ids) > 1 and ids[-1] in eos_ids:
        ids.pop()
    return ids


def _check_ids(value, name: str, vocab_size: int, fail) -> list[int]:
    param = name.partition("[")[0]
    if not isinstance(value, list) or not value:
        fail(f"'{name}' must be a non-empty list of token ids", param)
    if is_int_list(value) and 0 <= min(value) and max(value) < vocab_size:
        return list(value)  # checked in C; the loop below finds what is wrong, and says where
    for i, token_id in enumerate(value):
        if not is_int(token_id):
            fail(f"'{name}[{i}]' must be an integer token id, got {json.dumps(token_id)}", param)
        if not 0 <= token_id < vocab_size:
            fail(f"'{name}[{i}]' = {token_id} is out of range [0, {vocab_size})", param)
    return list(value)


def _parse_logit_bias(value, vocab_size: int, fail) -> dict[int, float]:
    """OpenAI's {"token id": bias} (JSON's keys are strings; integer keys are taken too)."""
    if not isinstance(value, dict) or len(value) > P.MAX_LOGIT_BIAS:
        fail(f"'logit_bias' must be an object of at most {P.MAX_LOGIT_BIAS} \"token id\": bias entries",
             "logit_bias")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not is_int(token) or not 0 <= token < vocab_size:
            fail(f"'logit_bias' key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if not is_number(bias) or not -P.MAX_BIAS <= bias <= P.MAX_BIAS:
            fail(f"'logit_bias[{key}]' must be a number from {-P.MAX_BIAS:g} to {P.MAX_BIAS:g}", "logit_bias")
        if bias:
            out[token] = float(bias)
    return out


def _parse_stop(value, tokenizer, vocab_size: int, fail) -> list[list[int]]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        fail("'stop' must be a string or a list of strings and token id lists", "stop")
    if len(items) > P.MAX_STOP_SEQS:
        fail(f"'stop' holds at most {P.MAX_STOP_SEQS} stop sequences", "stop")
    stop_ids = []
    for i, item in enumerate(items):
        name = "stop" if isinstance(value, str) else f"stop[{i}]"
        if isinstance(item, str):
            if not item:
                fail(f"'{name}' is an empty string", "stop")
            stop_ids.append(list(tokenizer.encode(item, add_special_tokens=False)))
        elif isinstance(item, list):
            stop_ids.append(_check_ids(item, name, vocab_size, fail))
        else:
            fail(f"'{name}' must be a string or a list of token ids", "stop")
        if len(stop_ids[-1]) > P.MAX_STOP_LEN:
            fail(f"'{name}' is {len(stop_ids[-1])} tokens; a stop sequence is at most {P.MAX_STOP_LEN}", "stop")
    return stop_ids


def _fit(prompt: Prompt, max_context: int) -> Prompt:
    num_prompt = len(prompt.prompt_ids)
    if num_prompt + 1 > max_context:
        raise PromptError(
            prompt.req_id,
            f"prompt is {num_prompt} tokens; the model's context is {max_context}", "prompt")
    room = max_context - num_prompt
    if prompt.max_new_tokens > room:
        prompt.note = (f"max_new_tokens {prompt.max_new_tokens} clamped to {room}: the prompt is "
                       f"{num_prompt} tokens of the model's {max_context}-token context")
        prompt.max_new_tokens = room
    return prompt

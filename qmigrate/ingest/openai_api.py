"""OpenAI-compatible requests (pure: no sockets, no HTTP server).

`parse_body` turns the JSON body of `POST /v1/completions` or `POST /v1/chat/completions`
into a validated `ApiRequest` (intake `Prompt`s plus how to answer), or raises `ApiError`
with OpenAI's status code, type and message. `fan_out` turns a request of several prompts
and/or `n` choices into one engine request per choice, as vLLM does. The replies are built in
`openai_replies.py`.

Choices are numbered as in OpenAI's API and vLLM: with P prompts and `n`, choice
`p * n + j` is prompt p's j-th. With a `seed`, choice j of every prompt samples with
`seed + j` (mod 2**63), as vLLM's child requests do: the choices differ, and the same
request gets the same choices again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from qmigrate.wire import protocol as P
from qmigrate.ingest.tools import Tools, ToolError, forced_grammar, parse_tools, parser_of
from qmigrate.ingest.prompts import MAX_SEED, Defaults, Prompt, PromptError, is_int_list, parse_request

Kind = Literal["completion", "chat"]

# Every field a client may send, by what this server does with it (docs/http.md lists them).
# Sampling fields (and return_token_ids) the intake (prompts.parse_request) checks alike for
# stdin JSONL and HTTP.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                   "logit_bias", "ignore_eos", "min_tokens", "cache_salt", "repetition_penalty", "min_p",
                   "stop_token_ids", "response_format", "structured_outputs", "return_token_ids")
# from top_k and ignore_eos on: extensions, as vLLM's (response_format on completions too)
SUPPORTED_FIELDS = frozenset(["model", "max_tokens", "stop", "stream", "stream_options", "n", "prompt_logprobs",
                              *SAMPLING_FIELDS])
ONLY_FIELDS = {"completion": frozenset(["prompt", "logprobs", "echo"]),
               "chat": frozenset(["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                  "tool_choice", "parallel_tool_calls"])}
# OpenAI's fields that change nothing this server generates: accepted, and ignored.
IGNORED_FIELDS = {"completion": frozenset(["user", "store", "metadata", "service_tier", "prompt_cache_key",
                                           "safety_identifier"]),
                  "chat": frozenset(["user", "store", "metadata", "service_tier", "prompt_cache_key",
                                     "safety_identifier", "prediction"])}
# Fields that would change the output, accepted only at the value that changes nothing
# (a field of one endpoint only is refused by the other as unrecognized).
NEUTRAL = {"best_of": (1,), "suffix": ("",), "functions": ([],), "function_call": ("none",),
           "modalities": (["text"],), "audio": (), "reasoning_effort": (), "verbosity": (), "web_search_options": ()}
NEUTRAL_OF = {"completion": frozenset(["best_of", "suffix"]),
              "chat": frozenset(["functions", "function_call", "modalities", "audio", "reasoning_effort", "verbosity",
                                 "web_search_options"])}
# The intake's names of fields the API names otherwise.
_INTAKE_PARAM = {"prompt_ids": "prompt"}


class ApiError(Exception):
    """An error answered with OpenAI's error object and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class ApiRequest:
    kind: Kind
    model: str
    prompts: list[Prompt]  # a completion's batch of prompts, in order; chat: one
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    n: int = 1             # choices per prompt
    continuous_usage: bool = False   # vLLM's continuous_usage_stats: usage in every chunk too
    logprobs: int = -1     # >= 0: each token's logprob, with this many alternatives (ingest/logprobs_api.py)
    prompt_logprobs: int = -1    # vLLM's: >= 0, the prompt's, with this many alternatives
    echo: bool = False     # completions: the prompt's text (and logprobs) before the choice's
    prompt_texts: list[str] = field(default_factory=list)   # with echo: each prompt's text
    grammar_param: str | None = None   # the field that asked for structured output
    tools: Tools | None = None       # chat's tools, tool_choice and the parser of their calls
    return_token_ids: bool = False   # vLLM's: the prompt's ids and each choice's generated ids too

    @property
    def prompt(self) -> Prompt:
        return self.prompts[0]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def has_extras(self) -> bool:
        """Its choices carry more than text: logprobs, an echo, or token ids."""
        return self.logprobs >= 0 or self.prompt_logprobs >= 0 or self.echo or self.return_token_ids


def not_found(model: str, model_names: Collection[str]) -> ApiError:
    return ApiError(404, f"'model': the model '{model}' does not exist; this server has "
                    f"{', '.join(sorted(model_names))}", "model", code="model_not_found")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _same(value, neutral) -> bool:
    return (type(value) is type(neutral) and value == neutral) or \
        (_is_number(value) and _is_number(neutral) and value == neutral)


def parse_body(body, kind: Kind, *, model_names: Collection[str], tokenizer, max_context: int,
               defaults: Defaults = Defaults(), eos_ids: Collection[int] = (),
               tool_parser: str = "auto", vocab_size: int | None = None) -> ApiRequest:
    """`vocab_size` bounds the ids a request names (default: the tokenizer's)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    known = SUPPORTED_FIELDS | ONLY_FIELDS[kind] | IGNORED_FIELDS[kind] | NEUTRAL_OF[kind]
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"'{unknown[0]}' is an unrecognized request argument", unknown[0])
    body = {key: value for key, value in body.items() if value is not None}
    for name in sorted(NEUTRAL_OF[kind] & set(body)):
        allowed = NEUTRAL[name]
        if not any(_same(body[name], a) for a in allowed):
            only = f" (only {allowed[0]!r})" if allowed else ""
            hint = "; 'n' asks for several choices" if name == "best_of" else ""
            raise ApiError(400, f"'{name}' is not supported by this server{only}{hint}", name)
    n = body.get("n", 1)
    if not _is_int(n) or not 1 <= n <= P.MAX_N:
        raise ApiError(400, f"'n' must be an integer from 1 to {P.MAX_N}", "n")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: a string naming the model", "model")
    if model not in model_names:
        raise not_found(model, model_names)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"} \
            or not all(isinstance(v, bool) for v in options.values()):
        raise ApiError(400, "'stream_options' must be {\"include_usage\": true|false, "
                       "\"continuous_usage_stats\": true|false}", "stream_options")
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")

    request = {}
    max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_name in body:
        if not _is_int(body[max_name]) or body[max_name] < 1:
            raise ApiError(400, f"'{max_name}' must be an integer >= 1", max_name)
        request["max_new_tokens"] = body[max_name]
    for name in SAMPLING_FIELDS:
        if name in body:
            request[name] = body[name]
    num_logprobs, echo = _parse_logprobs(body, kind)
    num_prompt = body.get("prompt_logprobs", -1)
    if not _is_int(num_prompt) or not (num_prompt == -1 or 0 <= num_prompt <= P.MAX_LOGPROBS):
        raise ApiError(400, f"'prompt_logprobs' must be an integer from 0 to {P.MAX_LOGPROBS}", "prompt_logprobs")
    request["logprobs"] = num_logprobs
    # echo with logprobs shows the prompt's tokens' too, with as many alternatives
    request["prompt_logprobs"] = max(num_prompt, num_logprobs) if echo and num_logprobs >= 0 else num_prompt
    stop = _parse_stop(body.get("stop", []))
    if stop:
        request["stop"] = stop
    tools = _tools(body, request, tool_parser, tokenizer, stream and n > 1) if kind == "chat" else None
    items = [{"messages": body.get("messages")}] if kind == "chat" else _completion_prompts(body.get("prompt"))
    if len(items) * n > P.MAX_CHOICES:
        raise ApiError(400, f"{len(items)} prompt(s) with n={n} is {len(items) * n} choices; this server "
                       f"answers at most {P.MAX_CHOICES} in one request", "n" if n > 1 else "prompt")
    prompts = []
    for i, item in enumerate(items):  # every prompt is checked before any is submitted
        try:
            prompts.append(parse_request({**request, **item}, "", tokenizer=tokenizer, max_context=max_context,
                                         defaults=defaults, eos_ids=eos_ids, vocab_size=vocab_size))
        except PromptError as exc:
            too_long = "the model's context" in exc.message
            param = _api_param(exc.param, kind, max_name)
            message = exc.message.replace("'max_new_tokens'", f"'{max_name}'")  # the name this client sent
            of_prompt = param in ("prompt", "messages") and len(items) > 1
            raise ApiError(400, f"prompt[{i}]: {message}" if of_prompt else message, param,
                           code="context_length_exceeded" if too_long else None) from None
    include = bool(options.get("include_usage"))
    texts = [item["prompt"] if "prompt" in item else tokenizer.decode(item["prompt_ids"]) for item in items] \
        if echo else []
    grammar_param = next((name for name in ("response_format", "structured_outputs") if name in body),
                         "tool_choice" if tools is not None and tools.is_forced else None)
    return ApiRequest(kind, model, prompts, stream, include, stop, n,
                      include and bool(options.get("continuous_usage_stats")), num_logprobs, num_prompt, echo, texts,
                      grammar_param, tools, prompts[0].return_token_ids)


def _parse_logprobs(body: dict, kind: Kind) -> tuple[int, bool]:
    """(alternatives per token, -1: no logprobs; echo) of a request: chat's `logprobs` (a
    boolean) and `top_logprobs`, a completion's `logprobs` (an integer) and `echo`."""
    top = P.MAX_LOGPROBS
    if kind == "chat":
        wanted = body.get("logprobs", False)
        if not isinstance(wanted, bool):
            raise ApiError(400, "'logprobs' must be a boolean", "logprobs")
        num = body.get("top_logprobs", 0 if wanted else -1)
        if "top_logprobs" in body and (not _is_int(num) or not 0 <= num <= top):
            raise ApiError(400, f"'top_logprobs' must be an integer from 0 to {top}", "top_logprobs")
        if "top_logprobs" in body and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return num, False
    num = body.get("logprobs", -1)
    if num is False:   # the value that asks for none
        num = -1
    elif not _is_int(num) or not (num == -1 and "logprobs" not in body or 0 <= num <= top):
        raise ApiError(400, f"'logprobs' must be an integer from 0 to {top}", "logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise ApiError(400, "'echo' must be a boolean", "echo")
    return num, echo


def _tools(body: dict, request: dict, parser: str, tokenizer, streams_choices: bool) -> Tools | None:
    """Chat's tools: into the template, and a forced call's grammar into the intake's request."""
    try:
        tools = parse_tools(body, parser_of(parser, getattr(tokenizer, "chat_template", None)))
    except ToolError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    if tools is None:
        return None
    request["tools"] = tools.template_tools()
    if tools.calls_expected and streams_choices:
        raise ApiError(400, "'n' > 1 with 'tools' is not streamed: send 'stream': false", "n")
    if tools.is_forced:
        if "response_format" in request or "structured_outputs" in request:
            raise ApiError(400, "'tool_choice' required or a named function cannot be combined with "
                           "'response_format' or 'structured_outputs'", "tool_choice")
        request["structured_outputs"] = {"grammar": forced_grammar(tools)}
    return tools


def fan_out(req: ApiRequest, rid: str) -> list[Prompt]:
    """One engine request per choice, choice i at index i (prompt i // n), named `rid` (one
    choice) or `rid-i`. A seeded choice j samples with seed + j; the prompt's ids are shared."""
    if req.n == 1 and len(req.prompts) == 1:
        req.prompt.req_id = rid
        return [req.prompt]
    out = []
    for prompt in req.prompts:
        for j in range(req.n):
            seed = None if prompt.seed is None else (prompt.seed + j) % MAX_SEED
            out.append(dataclasses.replace(prompt, req_id=f"{rid}-{len(out)}", seed=seed))
    return out


def _parse_stop(value) -> list[str]:
    """Stop strings; how many and how long is the intake's rule (prompts.py), as on stdin."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
    return list(items)


def _completion_prompts(prompt) -> list[dict]:
    """The intake form of each prompt of a completion request: a string, a list of token ids,
    or a batch (a list of strings and/or token id lists)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt, list) and prompt and is_int_list(prompt):
        return [{"prompt_ids": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > P.MAX_CHOICES:
            raise ApiError(400, f"at most {P.MAX_CHOICES} prompts in one request", "prompt")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_ids": p} for p in prompt]
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of those", "prompt")


def _api_param(param: str | None, kind: Kind, max_name: str) -> str | None:
    """The API's name of an intake field."""
    if param == "max_new_tokens":
        return max_name
    param = _INTAKE_PARAM.get(param, param)
    return "messages" if param == "prompt" and kind == "chat" else param

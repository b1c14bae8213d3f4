"""OpenAI-compatible requests and replies (pure: no sockets, no HTTP server).

`parse_body` turns the JSON body of `POST /v1/completions` or `POST /v1/chat/completions`
into a validated `ApiRequest` (an intake `Prompt` plus how to answer), or raises `ApiError`
with OpenAI's status code, type and message. The `*_reply` and `*_chunk` functions build
the objects the official clients expect; `StopTrimmer` removes a matched stop string from
the end of the text, as OpenAI does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from qmigrate.ingest.prompts import Defaults, Prompt, PromptError, is_int_list, parse_request

Kind = Literal["completion", "chat"]
MAX_STOPS = 4
MAX_TEMPERATURE = 2.0

COMMON_FIELDS = frozenset(["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                           "stream", "stream_options", "n", "user", "presence_penalty",
                           "frequency_penalty", "logit_bias", "logprobs",
                           "ignore_eos", "min_tokens", "cache_salt"])  # the last three: extensions, as vLLM's
ONLY_FIELDS = {"completion": frozenset(["prompt", "echo", "best_of", "suffix"]),
               "chat": frozenset(["messages", "max_completion_tokens", "top_logprobs", "response_format",
                                  "tools", "tool_choice", "functions", "function_call",
                                  "parallel_tool_calls"])}
# Fields that would change the output, accepted only at the value that changes nothing.
NEUTRAL = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
           "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "best_of": (1,),
           "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
           "function_call": ("none",), "response_format": ({"type": "text"},)}


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
    prompt: Prompt
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _same(value, neutral) -> bool:
    return (type(value) is type(neutral) and value == neutral) or \
        (_is_number(value) and _is_number(neutral) and value == neutral)


def parse_body(body, kind: Kind, *, model_names: Collection[str], tokenizer, max_context: int,
               defaults: Defaults = Defaults(), eos_ids: Collection[int] = ()) -> ApiRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    known = COMMON_FIELDS | ONLY_FIELDS[kind]
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    body = {key: value for key, value in body.items() if value is not None}
    for name, allowed in NEUTRAL.items():
        if name in body and not any(_same(body[name], a) for a in allowed):
            raise ApiError(400, f"'{name}' is not supported by this server (only {allowed[0]!r})", name)

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: a string naming the model", "model")
    if model not in model_names:
        raise ApiError(404, f"the model '{model}' does not exist; this server has {', '.join(sorted(model_names))}",
                       "model", code="model_not_found")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be {\"include_usage\": true|false}", "stream_options")
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")

    request = {}
    max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_name in body:
        if not _is_int(body[max_name]) or body[max_name] < 1:
            raise ApiError(400, f"'{max_name}' must be an integer >= 1", max_name)
        request["max_new_tokens"] = body[max_name]
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE):
        raise ApiError(400, f"'temperature' must be a number from 0 to {MAX_TEMPERATURE:g}", "temperature")
    for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens", "cache_salt"):
        if name in body:
            request[name] = body[name]
    stop = _parse_stop(body.get("stop", []))
    if stop:
        request["stop"] = stop
    if kind == "chat":
        request["messages"] = body.get("messages")
    else:
        request.update(_completion_prompt(body.get("prompt")))
    try:
        prompt = parse_request(request, "", tokenizer=tokenizer, max_context=max_context,
                               defaults=defaults, eos_ids=eos_ids)
    except PromptError as exc:
        too_long = "the model's context" in exc.message
        raise ApiError(400, exc.message, _param_of(exc.message, kind),
                       code="context_length_exceeded" if too_long else None) from None
    return ApiRequest(kind, model, prompt, stream, bool(options.get("include_usage")), stop)


def _parse_stop(value) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOPS \
            or not all(isinstance(s, str) and s for s in items):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return list(items)


def _completion_prompt(prompt) -> dict:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and is_int_list(prompt):
        return {"prompt_ids": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "one prompt per request: this server does not batch prompts", "prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")


def _param_of(message: str, kind: Kind) -> str | None:
    for key, param in (("messages", "messages"), ("prompt", "prompt" if kind == "completion" else "messages"),
                       ("min_tokens", "min_tokens"), ("ignore_eos", "ignore_eos"), ("cache_salt", "cache_salt"),
                       ("max_new_tokens", "max_tokens"), ("temperature", "temperature"),
                       ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"), ("stop", "stop")):
        if key in message:
            return param
    return None


class StopTrimmer:
    """Holds back the last few characters of a stream so that a stop string the model ended
    with can be cut off at the end (the stop tokens are generated, but OpenAI's text omits them)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = sorted(stops, key=len, reverse=True)
        self.hold = len(self.stops[0]) if self.stops else 0
        self.held = ""

    def push(self, text: str) -> str:
        if not self.hold:
            return text
        self.held += text
        out, self.held = self.held[:-self.hold], self.held[-self.hold:]
        return out

    def finish(self, stopped: bool) -> str:
        held, self.held = self.held, ""
        for stop in self.stops if stopped else ():
            if held.endswith(stop):
                return held[: -len(stop)]
        return held


def usage(num_prompt: int, num_completion: int, num_cached: int = -1) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens when the worker said how
    much of the prompt it found in its prefix cache (num_cached >= 0)."""
    out = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
           "total_tokens": num_prompt + num_completion}
    if num_cached >= 0:
        out["prompt_tokens_details"] = {"cached_tokens": min(num_cached, num_prompt)}
    return out


def reply(req: ApiRequest, rid: str, created: int, text: str, finish: str, num_tokens: int,
          num_cached: int = -1) -> dict:
    """The whole answer of a request that did not stream."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": created, "model": req.model, "choices": [choice],
            "usage": usage(len(req.prompt.prompt_ids), num_tokens, num_cached)}


def chunk(req: ApiRequest, rid: str, created: int, text: str | None, finish: str | None = None,
          first: bool = False) -> dict:
    """One streamed event: new text (None in the last, which carries the finish reason)."""
    if req.kind == "chat":
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out = {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
           "created": created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: ApiRequest, rid: str, created: int, num_tokens: int, num_cached: int = -1) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": created, "model": req.model, "choices": [],
            "usage": usage(len(req.prompt.prompt_ids), num_tokens, num_cached)}


def models_list(names: list[str], max_context: int) -> dict:
    created = int(time.time())
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "qmigrate", "max_model_len": max_context}
                                       for name in names]}

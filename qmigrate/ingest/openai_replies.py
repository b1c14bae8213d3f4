"""OpenAI-compatible replies (pure: no sockets, no HTTP server).

`reply`, `chunk`, `tool_chunk` and `usage_chunk` build the objects the official clients
expect from a request parsed by `openai_api.parse_body`; `Choices` gathers a fanned-out
request's choices as the detokenizer's rows come; `StopTrimmer` removes a matched stop string
from the end of the text, as OpenAI does. `usage` counts each prompt's tokens once, however
many choices it has (as OpenAI and vLLM do), and every choice's completion tokens.
"""

from __future__ import annotations

import time

from qmigrate.wire import protocol as P
from qmigrate.ingest import logprobs_api as LP
from qmigrate.ingest.logprobs_api import ChoiceExtras
from qmigrate.ingest.openai_api import ApiError, ApiRequest
from qmigrate.ingest.tools import message_calls, parse_calls


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


class Choices:
    """The choices of a fanned-out request as the detokenizer's rows come: (seq_id, text,
    finish code, tokens so far[, cached prompt tokens]). `live` (seq_id -> choice index) loses
    each choice as it ends; `ends[i]` is (finish reason, completion tokens, cached or -1) once
    choice i has ended."""

    def __init__(self, req: ApiRequest, live: dict[int, int], text: LP.TokenText | None = None) -> None:
        self.live, self.index = live, dict(live)
        self.extras = [ChoiceExtras(req, i, text) for i in range(len(live))] if req.has_extras else None
        self.trims = [StopTrimmer(req.stop) for _ in live]
        self.ends: list[tuple[str, int, int] | None] = [None] * len(live)
        self.num_tokens = [0] * len(live)   # tokens so far, by choice

    def take(self, rows) -> tuple[dict[int, str], list[int]]:
        """The new text of each choice in `rows`, by index in the order they came, and the
        choices that ended; ApiError (500) for a choice that a worker could not run."""
        texts: dict[int, str] = {}
        ended = []
        for row in rows:
            if row[0] not in self.live:
                continue
            i = self.index[row[0]]
            self.num_tokens[i] = row[3]
            if self.extras is not None:
                self.extras[i].push_row(row)
            text = self.trims[i].push(row[1])
            if row[2]:
                del self.live[row[0]]
                reason = P.Finish(row[2]).openai_reason
                if reason is None:
                    raise ApiError(500, f"the worker could not run choice {i} of this request", type="server_error")
                text += self.trims[i].finish(row[2] == P.Finish.STOP)
                self.ends[i] = (reason, row[3], row[4] if len(row) > 4 else -1)
                ended.append(i)
            texts[i] = texts[i] + text if i in texts else text
        return texts, ended

    def counts(self) -> list[tuple[int, int]]:
        return [(end[1], end[2]) for end in self.ends]


def usage(num_prompt: int, num_completion: int, num_cached: int = -1) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens when the worker said how
    much of the prompt it found in its prefix cache (num_cached >= 0)."""
    out = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
           "total_tokens": num_prompt + num_completion}
    if num_cached >= 0:
        out["prompt_tokens_details"] = {"cached_tokens": min(num_cached, num_prompt)}
    return out


def total_usage(req: ApiRequest, counts: list[tuple[int, int]]) -> dict:
    """The usage of a request from (completion tokens, prompt tokens found cached or -1) of
    each choice, by index. Each prompt's tokens count once; its cached tokens are the fewest
    any of its choices found (the prefix that all of them reused), summed over the prompts,
    and left out when no worker said."""
    n, num_prompt, num_cached, known = req.n, 0, 0, False
    for p, prompt in enumerate(req.prompts):
        num_prompt += len(prompt.prompt_ids)
        cached = [c for _, c in counts[p * n:(p + 1) * n] if c >= 0]
        if cached:
            num_cached += min(min(cached), len(prompt.prompt_ids))
            known = True
    return usage(num_prompt, sum(num for num, _ in counts), num_cached if known else -1)


def reply(req: ApiRequest, rid: str, created: int, outcomes: list[tuple[str, str, int, int]],
          extras: list[ChoiceExtras] | None = None) -> dict:
    """The whole answer of a request that did not stream, from (text, finish reason,
    completion tokens, cached prompt tokens or -1) of each choice, by index, and what each
    carries beside (`extras`)."""
    choices = []
    for i, (text, finish, _, _) in enumerate(outcomes):
        extra = extras[i] if extras else None
        logprobs = extra.whole() if extra is not None else None
        if req.kind == "chat":
            message = {"role": "assistant", "content": text}
            if req.tools is not None and req.tools.calls_expected:
                content, calls = parse_calls(text, req.tools)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": message_calls(calls)}
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": finish})
        else:
            choices.append({"index": i, "text": extra.with_echo(text) if extra else text,
                            "logprobs": logprobs, "finish_reason": finish})
            if extra is not None and req.prompt_logprobs >= 0:
                choices[-1]["prompt_logprobs"] = extra.take_prompt()
            if req.return_token_ids:   # vLLM's place: each choice, its prompt's too
                choices[-1]["prompt_token_ids"] = extra.take_prompt_ids()
        if req.return_token_ids:
            choices[-1]["token_ids"] = extra.ids
    out = {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
           "created": created, "model": req.model, "choices": choices,
           "usage": total_usage(req, [(num, cached) for _, _, num, cached in outcomes])}
    if req.kind == "chat" and req.return_token_ids:
        out["prompt_token_ids"] = list(req.prompt.prompt_ids)   # vLLM's place: the request's one prompt
    if req.kind == "chat" and req.prompt_logprobs >= 0 and extras:
        out["prompt_logprobs"] = extras[0].take_prompt()   # vLLM's place: the request's one prompt
    return out


def chunk(req: ApiRequest, rid: str, created: int, text: str | None, finish: str | None = None,
          first: bool = False, index: int = 0, num_tokens: int = 0, extra: ChoiceExtras | None = None) -> dict:
    """One streamed event of choice `index`: new text (None in its last, which carries the
    finish reason); with continuous usage, the usage of that choice's `num_tokens` so far;
    with `extra`, the logprobs that came since its last event (and the prompt's, once), and
    with return_token_ids the ids (and the prompt's, in the choice's first event)."""
    logprobs = extra.fresh() if extra is not None and text is not None else None
    if req.kind == "chat":
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        if extra is not None and text is not None:
            text = extra.with_echo(text)
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if extra is not None and req.prompt_logprobs >= 0 and (prompt := extra.take_prompt()) is not None:
            choice["prompt_logprobs"] = prompt
    out = {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
           "created": created, "model": req.model, "choices": [choice]}
    if extra is not None and req.return_token_ids and text is not None:
        if (prompt_ids := extra.take_prompt_ids()) is not None:   # vLLM's places, as in `reply`
            (out if req.kind == "chat" else choice)["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = extra.fresh_ids()
    if req.kind == "chat" and extra is not None and req.prompt_logprobs >= 0 \
            and (prompt := extra.take_prompt()) is not None:
        out["prompt_logprobs"] = prompt
    if req.include_usage:
        out["usage"] = None
        if req.continuous_usage:
            out["usage"] = usage(len(req.prompts[index // req.n].prompt_ids), num_tokens)
    return out


def tool_chunk(req: ApiRequest, rid: str, created: int, deltas: list[dict]) -> dict:
    """A streamed event of tool call deltas (chat's one choice)."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
            "choices": [{"index": 0, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}]}


def usage_chunk(req: ApiRequest, rid: str, created: int, counts: list[tuple[int, int]]) -> dict:
    """The last event of a stream with `include_usage`; counts as for `total_usage`."""
    return {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": created, "model": req.model, "choices": [], "usage": total_usage(req, counts)}


def models_list(names: list[str], max_context: int) -> dict:
    created = int(time.time())
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "qmigrate", "max_model_len": max_context}
                                       for name in names]}

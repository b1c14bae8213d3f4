"""Logprobs in OpenAI's shapes (pure: no sockets), from what the detokenizer sends back.

A token's entry is (token id, values, top ids): values[0] its logprob, then the top
alternatives' logprobs (ids in top ids, best first; -1 past what was computed); a prompt
position's is (values, top ids) with its rank in values[1] (engine/logprobs.py).

- chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token,
  logprob, bytes}]}]}`, `top_logprobs` the `top_logprobs` likeliest;
- completions: `choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`,
  each top_logprobs a {token: logprob} of the `logprobs` likeliest and the token itself (up
  to logprobs + 1 entries, as OpenAI's); with `echo` the prompt's tokens first (its first
  token has no logprob: null);
- vLLM's `prompt_logprobs`: [null, {"id": {logprob, rank, decoded_token}}, ...], each
  position's token and the likeliest alternatives.
A token's text is what the tokenizer decodes for it alone, its bytes that text's UTF-8.
`ChoiceExtras` gathers one choice's as the detokenizer's rows come (with an echoed prompt).

A stream's events carry each token's logprobs once: there (without echo or prompt logprobs)
the tokens wait as they came, and `ChoiceExtras.fresh_json` writes their JSON text straight
from them, each token's text and bytes encoded once per id (`TokenText.json`), instead of
building the dicts and encoding them whole; the stream's HTTP process does this per token.
"""

from __future__ import annotations

import json
import math

from qmigrate.wire import protocol as P


class TokenText:
    """Token id -> (text, UTF-8 bytes), decoded once per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.known: dict[int, tuple[str, list[int]]] = {}

        self.encoded: dict[int, tuple[str, str, str]] = {}
        self.pieces: dict[int, tuple[str, str, str]] = {}   # token id -> its streamed JSON's fixed parts

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        out = self.known.get(token_id)
        if out is None:
            text = self.tokenizer.decode([token_id]) if token_id >= 0 else ""
            out = self.known[token_id] = (text, list(text.encode("utf-8")))
        return out

    def json(self, token_id: int) -> tuple[str, str, str]:
        """The token's text, and the JSON of its text and of its bytes (as json.dumps writes them)."""
        out = self.encoded.get(token_id)
        if out is None:
            text, raw = self(token_id)
            out = self.encoded[token_id] = (text, json.dumps(text, ensure_ascii=False), json.dumps(raw))
        return out


    def pieces_of(self, token_id: int) -> tuple[str, str, str]:
        """The fixed parts of a token's JSON in a stream's logprobs, around its logprob: as a
        completion's top_logprobs key ('"text": '), as a chat alternative ('{"token": "text",
        "logprob": ' and ', "bytes": [...]}'). Made once per id."""
        out = self.pieces.get(token_id)
        if out is None:
            _, text, raw = self.json(token_id)
            out = self.pieces[token_id] = (text + ": ", '{"token": ' + text + ', "logprob": ', ', "bytes": ' + raw + "}")
        return out


_text = P.logprob_text      # a logprob's JSON number (one rule for every output: wire/packed.py)
_value = P.logprob_value    # and as the dicts hold it


def _top(values, ids, num: int, skip: int) -> list[tuple[int, float]]:
    return [(t, v) for t, v in zip(ids[:num], values[skip:skip + num]) if t >= 0]


def _num(v) -> str:
    """A logprob's JSON, as _value and json.dumps make it."""
    v = float(v)
    return "null" if math.isnan(v) else _text(v)


def chat_content_json(entries, num_top: int, text: TokenText) -> str:
    """chat_content's JSON text (each id's fixed parts made once: TokenText.pieces_of)."""
    items, pieces, made = [], text.pieces, text.pieces_of
    for token_id, values, ids in entries:
        _, head, tail = pieces.get(token_id) or made(token_id)
        if values is None:
            items.append(head + "null" + tail[:-1] + ', "top_logprobs": []}')
            continue
        top = []
        for t, v in zip(ids[:num_top], values[1:1 + num_top]):
            if t >= 0:
                _, h, e = pieces.get(t) or made(t)
                top.append(h + _text(v) + e)
        items.append(head + _num(values[0]) + tail[:-1] + ', "top_logprobs": [' + ", ".join(top) + "]}")
    return "[" + ", ".join(items) + "]"


def chat_content(entries, num_top: int, text: TokenText) -> list[dict]:
    out = []
    for token_id, values, ids in entries:
        token, raw = text(token_id)
        item = {"token": token, "logprob": None if values is None else _value(values[0]), "bytes": raw,
                "top_logprobs": []}
        if values is not None:
            for t, v in _top(values, ids, num_top, 1):
                s, b = text(t)
                item["top_logprobs"].append({"token": s, "logprob": float(_text(v)), "bytes": b})
        out.append(item)
    return out


class CompletionLogprobs:
    """A completion choice's logprobs object, built as its tokens come; `take()` gives what
    came since the last call (a stream's chunk), `whole` everything."""

    def __init__(self, num_top: int, text: TokenText) -> None:
        self.num_top, self.text, self.offset = num_top, text, 0
        self.whole = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.fresh = 0

    def add(self, token_id: int, logprob, top: list[tuple[int, float]] | None) -> None:
        token = self.text(token_id)[0]
        w = self.whole
        w["tokens"].append(token)
        w["token_logprobs"].append(logprob)
        if top is None:
            w["top_logprobs"].append(None)
        else:
            d = {self.text(t)[0]: float(_text(v)) for t, v in top}
            d.setdefault(token, logprob)
            w["top_logprobs"].append(d)
        w["text_offset"].append(self.offset)
        self.offset += len(token)

    def add_tokens(self, entries) -> None:
        for token_id, values, ids in entries:
            if values is None:
                self.add(token_id, None, None)
            else:
                self.add(token_id, _value(values[0]), _top(values, ids, self.num_top, 1))

    def add_prompt(self, prompt_ids: list[int], positions, echo_text: str) -> None:
        """Echo: the prompt's tokens, the first without a logprob. Their offsets end where
        `echo_text` (the prompt as the client sent it) ends, so that a BOS the client did not
        write counts for nothing: the generated tokens' offsets index the choice's text."""
        start = len(self.whole["tokens"])
        self.offset = len(echo_text) - sum(len(self.text(t)[0]) for t in prompt_ids)
        self.add(prompt_ids[0], None, None)
        for token_id, (values, ids) in zip(prompt_ids[1:], positions or [(None, None)] * (len(prompt_ids) - 1)):
            if values is None:
                self.add(token_id, None, None)
            else:
                self.add(token_id, _value(values[0]), _top(values, ids, self.num_top, 2))
        offsets = self.whole["text_offset"]
        offsets[start:] = [max(0, o) for o in offsets[start:]]

    def take(self) -> dict:
        start, self.fresh = self.fresh, len(self.whole["tokens"])
        return {k: v[start:] for k, v in self.whole.items()}

    def tokens_json(self, entries) -> str:
        """The JSON of what add_tokens(entries) then take() give, without keeping them (a
        stream's): only the text offset goes on."""
        enc, pieces, made = self.text.json, self.text.pieces, self.text.pieces_of
        num, tokens, lps, tops, offsets = self.num_top, [], [], [], []
        for token_id, values, ids in entries:
            token, token_json, _ = enc(token_id)
            tokens.append(token_json)
            offsets.append(str(self.offset))
            self.offset += len(token)
            if values is None:
                lps.append("null")
                tops.append("null")
                continue
            logprob = _num(values[0])
            lps.append(logprob)
            top = {}   # a text two ids decode to: where it came first, the later logprob (as a dict)
            for t, v in zip(ids[:num], values[1:1 + num]):
                if t >= 0:
                    key = (pieces.get(t) or made(t))[0]
                    top[key] = key + _text(v)
            key = token_json + ": "
            if key not in top:
                top[key] = key + logprob
            tops.append("{" + ", ".join(top.values()) + "}")
        return (f'{{"tokens": [{", ".join(tokens)}], "token_logprobs": [{", ".join(lps)}], '
                f'"top_logprobs": [{", ".join(tops)}], "text_offset": [{", ".join(offsets)}]}}')


def prompt_logprobs(prompt_ids: list[int], positions, num_top: int, text: TokenText) -> list:
    """vLLM's prompt_logprobs of a prompt: None for its first token, then a dict per position."""
    out = [None]
    for token_id, (values, ids) in zip(prompt_ids[1:], positions):
        d = {str(token_id): {"logprob": _value(values[0]), "rank": int(values[1]), "decoded_token": text(token_id)[0]}}
        for rank, (t, v) in enumerate(_top(values, ids, num_top, 2), start=1):
            d.setdefault(str(t), {"logprob": float(_text(v)), "rank": rank, "decoded_token": text(t)[0]})
        out.append(d)
    return out


class ChoiceExtras:
    """What a choice carries beside its text (logprobs, prompt logprobs, an echoed prompt, token
    ids), fed the detokenizer's rows as they come: `fresh()` what came since the last call (a
    stream's chunk), `whole()` all of it; `fresh_ids()` and `ids` likewise."""

    def __init__(self, req, index: int, text: TokenText) -> None:
        """`req`: the request (openai_api.ApiRequest); `index`: the choice's."""
        p = index // req.n
        self.req, self.text, self.prompt_ids = req, text, req.prompts[p].prompt_ids
        self.prompt_text = self.echo_text = req.prompt_texts[p] if req.echo else ""
        self.content: list[dict] = []
        self.num_fresh = 0
        self.completion = CompletionLogprobs(req.logprobs, text) \
            if req.kind == "completion" and req.logprobs >= 0 else None
        self.prompt: list | None = None     # vLLM's prompt_logprobs, once they came
        self.prompt_sent = False
        self.started = False
        self.ids: list[int] = []   # with return_token_ids: the generated ids so far
        self.num_ids_sent = 0
        self.prompt_ids_sent = False
        # a stream's tokens wait here as they came, until its next event takes them
        self.waiting: list | None = [] if req.stream and not req.echo and req.prompt_logprobs < 0 \
            and req.logprobs >= 0 and not req.return_token_ids else None

    def push_row(self, row: tuple) -> None:
        """A detokenizer's row (ingest.handoff.reply_rows): its logprobs, its prompt's, its ids."""
        if len(row) > 5:
            self.push(row[5], row[6])
            if len(row) > 7:
                self.ids += row[7]
        else:
            self.push(None, None)

    @property
    def ids_due(self) -> bool:
        """Ids came that no chunk has carried yet."""
        return len(self.ids) > self.num_ids_sent

    def fresh_ids(self) -> list[int]:
        start, self.num_ids_sent = self.num_ids_sent, len(self.ids)
        return self.ids[start:]

    def take_prompt_ids(self) -> list[int] | None:
        """The prompt's ids, once (a stream's first chunk of the choice carries them)."""
        if self.prompt_ids_sent:
            return None
        self.prompt_ids_sent = True
        return list(self.prompt_ids)

    def push(self, lps, positions) -> None:
        if self.waiting is not None:
            if lps:
                self.waiting += lps
            return
        req = self.req
        if not self.started:   # the prompt's part comes with the first row
            self.started = True
            if positions is not None and req.prompt_logprobs >= 0:
                self.prompt = prompt_logprobs(self.prompt_ids, positions, req.prompt_logprobs, self.text)
            if req.echo and self.completion is not None:
                self.completion.add_prompt(self.prompt_ids, positions, self.prompt_text)
        if lps:
            if self.completion is not None:
                self.completion.add_tokens(lps)
            elif req.logprobs >= 0:
                self.content += chat_content(lps, req.logprobs, self.text)

    def with_echo(self, text: str) -> str:
        """The text, after the echoed prompt the first time."""
        if self.echo_text:
            text, self.echo_text = self.echo_text + text, ""
        return text

    def _take_waiting(self) -> None:
        """Give the waiting tokens to the dict-building path."""
        lps, self.waiting = self.waiting, None
        if lps:
            self.push(lps, None)
        self.waiting = []

    def fresh_json(self) -> str | None:
        """The JSON text of fresh() for a stream whose tokens wait (None for any other)."""
        if self.waiting is None:
            return None
        lps, self.waiting = self.waiting, []
        if self.completion is not None:
            return self.completion.tokens_json(lps)
        return f'{{"content": {chat_content_json(lps, self.req.logprobs, self.text)}}}'

    def fresh(self) -> dict | None:
        if self.waiting is not None:
            self._take_waiting()
        if self.completion is not None:
            return self.completion.take()
        if self.req.logprobs < 0:
            return None
        start, self.num_fresh = self.num_fresh, len(self.content)
        return {"content": self.content[start:]}

    def whole(self) -> dict | None:
        if self.completion is not None:
            return self.completion.whole
        return {"content": self.content} if self.req.logprobs >= 0 else None

    def take_prompt(self) -> list | None:
        if self.prompt is None or self.prompt_sent:
            return None
        self.prompt_sent = True
        return self.prompt

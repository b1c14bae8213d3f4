"""The HTTP client of `qmigrate bench serve`: one streamed call at a time per coroutine,
timestamped chunk by chunk as its events arrive, read cheaply (`EventTexts`).
Sessions go as chat messages, as plain-text completions (`serve_data.transcript`), or as
token-id completions that ask for the answer's ids back (`return_token_ids`, vLLM's)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp

from qmigrate.bench.serve_data import ServeRequest, transcript
from qmigrate.bench.serve_stats import CallRecord

READ_TIMEOUT_S = 600.0
JSON_HEADERS = {"Content-Type": "application/json"}


# What a JSON string's bytes may hold for them to be its text as they stand.
_NEEDS_DECODING = re.compile(rb'["\\\x00-\x1f]')


def _json_string(literal: bytes) -> str | None:
    """The str a JSON string literal stands for, or None where `literal` is not one."""
    if len(literal) < 2 or literal[:1] != b'"' or literal[-1:] != b'"':
        return None
    body = literal[1:-1]
    if _NEEDS_DECODING.search(body) is None:
        try:
            return body.decode()
        except UnicodeDecodeError:
            return None
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class EventTexts:
    """Reads a stream's middle events without json.loads. A server sends them as the same
    bytes but for the JSON string of their text; once two parsed events have shown the bytes
    around it, an event with those bytes is its text's string, sliced out. Any other event
    (the first, the finish, usage, an error, another server's other shape) is parsed in full."""

    __slots__ = ("head", "tail", "guess")

    def __init__(self) -> None:
        self.head = self.tail = None   # the bytes around the text, once confirmed
        self.guess = None              # (head, tail) seen once, to be confirmed

    def text_of(self, raw: bytes) -> str | None:
        """The text of `raw` where it has the learned shape, else None (parse it)."""
        head, tail = self.head, self.tail
        if head is None or not raw.startswith(head) or not raw.endswith(tail) \
                or len(raw) < len(head) + len(tail):
            return None
        return _json_string(raw[len(head):len(raw) - len(tail)])

    def learn(self, raw: bytes, text: str) -> None:
        """`raw` parsed in full to a middle event (one choice, this text, no finish, usage
        or error): where its text's string sits, if it sits there just once."""
        if self.guess is not None:
            head, tail = self.guess
            if raw.startswith(head) and raw.endswith(tail) and len(raw) >= len(head) + len(tail) \
                    and _json_string(raw[len(head):len(raw) - len(tail)]) == text:
                self.head, self.tail = head, tail
                return
        self.guess = None
        for literal in {json.dumps(text, ensure_ascii=False).encode(), json.dumps(text).encode()}:
            at = raw.find(literal)
            if at >= 0 and raw.find(literal, at + 1) < 0:
                self.guess = raw[:at], raw[at + len(literal):]
                return


class Client:
    def __init__(self, base_url: str, model: str, *, extensions: bool = True, temperature: float = 0.0,
                 sessions_as: str = "chat", logprobs: int = -1):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.logprobs = logprobs         # >= 0: every call asks for logprobs with this many alternatives
        self.extensions, self.temperature = extensions, temperature
        self.sessions_as = sessions_as   # chat, text (plain-text completions) or ids (token-id completions)
        self.salt: str | None = None     # the cache_salt every call sends, if any
        self.session = None

    async def __aenter__(self):
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=READ_TIMEOUT_S)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    def _payload(self, output_len: int) -> dict:
        body = {"model": self.model, "max_tokens": output_len, "stream": True, "temperature": self.temperature,
                "stream_options": {"include_usage": True}}
        if self.extensions:
            body.update(ignore_eos=True, min_tokens=output_len)
        if self.salt is not None:
            body["cache_salt"] = self.salt
        return body

    async def complete(self, prompt, output_len: int, rec: CallRecord) -> str:
        return await self.post_completion(self.completion_body(prompt, output_len), rec)

    def completion_body(self, prompt, output_len: int, response_format: dict | None = None) -> bytes:
        body = self._payload(output_len) | {"prompt": prompt}
        if response_format is not None:   # the grammar ends it, not ignore_eos (which it excludes)
            body.pop("ignore_eos", None)
            body.pop("min_tokens", None)
            body["response_format"] = response_format
        if self.logprobs >= 0:
            body["logprobs"] = self.logprobs
        return json.dumps(body).encode()

    def bodies(self, requests: list[ServeRequest]) -> list[bytes | None]:
        """Every completion's body, encoded before the clock starts (a session's depends on
        its answers: None); encoding 1,024 prompts of 1,152 ids took 150 ms of the client."""
        return [None if r.is_session else self.completion_body(r.prompt, r.output_len, r.response_format)
                for r in requests]

    async def post_completion(self, body: bytes, rec: CallRecord) -> str:
        return await self._stream("/v1/completions", body, rec, chat=False)

    async def chat(self, messages: list[dict], output_len: int, rec: CallRecord) -> str:
        body = self._payload(output_len) | {"messages": messages}
        if self.logprobs >= 0:
            body.update(logprobs=True, top_logprobs=self.logprobs)
        return await self._stream("/v1/chat/completions", body, rec, chat=True)

    async def complete_ids(self, prompt: list[int], output_len: int, rec: CallRecord) -> list[int]:
        """A completion of a token-id prompt; the ids of its answer, as the server returned them."""
        ids: list[int] = []
        await self._stream("/v1/completions", self._payload(output_len) | {"prompt": prompt, "return_token_ids": True},
                           rec, chat=False, ids=ids)
        return ids

    async def _stream(self, path: str, body: dict | bytes, rec: CallRecord, chat: bool,
                      ids: list[int] | None = None) -> str:
        """Sends one call and reads its events; the text is returned, timings go to `rec`, and
        the events' token ids to `ids` (a list; every event is then parsed in full)."""
        parts, chunks = [], 0
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        rec.start = time.perf_counter()
        try:
            async with self.session.post(self.base_url + path, data=body, headers=JSON_HEADERS) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return ""
                buf, done, texts = b"", False, EventTexts()
                # Whole reads, split into events here: one await per read, not one per line;
                # events that arrived in one read share its timestamp.
                async for data in resp.content.iter_any():
                    now = time.perf_counter()
                    *events, buf = (buf + data).split(b"\n\n")
                    for raw in events:
                        if ids is None and (text := texts.text_of(raw)) is not None:   # a middle event
                            rec.chunks.append(now)
                            parts.append(text)
                            chunks += 1
                            continue
                        if not raw.startswith(b"data: "):
                            continue
                        if raw[6:].strip() == b"[DONE]":
                            done = True
                            break
                        event = json.loads(raw[6:])
                        if "error" in event:
                            rec.error = str(event["error"].get("message", event["error"]))[:200]
                            done = True
                            break
                        choices = event.get("choices") or ()
                        for choice in choices:
                            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                            # an event of the stream's tokens, its text empty or not (a token may
                            # end in the middle of a character), as vLLM's benchmark counts
                            # them; not a closing event of no text
                            if isinstance(text, str) and (text or choice.get("finish_reason") is None):
                                rec.chunks.append(now)
                                parts.append(text)
                                chunks += 1
                            if ids is not None and isinstance(choice.get("token_ids"), list):
                                ids += choice["token_ids"]
                        usage = event.get("usage")
                        if isinstance(text, str) and len(choices) == 1 and not usage \
                                and choices[0].get("finish_reason") is None:
                            texts.learn(raw, text)
                        if usage:
                            rec.output_tokens = usage.get("completion_tokens", 0)
                            rec.prompt_tokens = usage.get("prompt_tokens", 0)
                            details = usage.get("prompt_tokens_details") or {}
                            if isinstance(details.get("cached_tokens"), int):
                                rec.cached_tokens = details["cached_tokens"]
                    if done:
                        break
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:200]
        if not rec.output_tokens:
            rec.output_tokens = chunks
        if not rec.error and not rec.chunks:
            rec.error = "no tokens"
        return "".join(parts)

    async def session_call(self, turns: list[str], answers: list[str], output_len: int, rec: CallRecord) -> str:
        """The call for the last of `turns`, after the earlier ones were answered so."""
        if self.sessions_as == "text":
            return await self.complete(transcript(turns, answers), output_len, rec)
        messages = []
        for turn, answer in zip(turns, [*answers, None]):
            messages.append({"role": "user", "content": turn})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return await self.chat(messages, output_len, rec)

    async def takes_chat(self) -> bool:
        """False when the server refuses chat messages for want of a chat template (an HTTP 400
        that says so, as qmigrate and vLLM answer)."""
        body = self._payload(1) | {"messages": [{"role": "user", "content": "hello"}]}
        async with self.session.post(self.base_url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 400:
                return True
            return "template" not in (await resp.text()).lower()

    async def first_model(self) -> str:
        async with self.session.get(self.base_url + "/v1/models") as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {self.base_url}/v1/models answered HTTP {resp.status}")
            data = (await resp.json()).get("data") or []
        if not data:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model")
        return data[0]["id"]

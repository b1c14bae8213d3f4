"""Datasets of `qmigrate bench serve`: what each request asks, before any timing.

A request is a completion (a prompt of token ids or text, and an exact output length), or, in
the multi-turn dataset, a session: user turns sent one after another on /v1/chat/completions,
each carrying every earlier turn and the server's answers to them. For a model without a chat
template a session goes to /v1/completions instead, as one plain-text prompt (`transcript`).
Sessions sent as token ids (`with_turn_ids`) go to /v1/completions as the ids of the
conversation so far: each turn's prompt is the one before, the ids of the answer to it, and
the ids of the next user turn.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from qmigrate.bench.core import Workload

# Filler for text prompts when no tokenizer is given: short common words, about a token each.
WORDS = ("the of and to in is was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she "
         "which do their time if will way about many then them write would like so these her long "
         "make thing see him two has look more day could go come did number sound no most people "
         "my over know water than call first who may down side been now find").split()


@dataclass(slots=True)
class ServeRequest:
    prompt: list[int] | str         # token ids or text (completions)
    output_len: int
    turns: list[str] = field(default_factory=list)   # a multi-turn session: its user turns, in order
    prompt_len: int = 0             # ids in the prompt, where known (token-id prompts)
    # a session's answers as the dataset gives them, sent in place of the server's (empty: each
    # later turn carries what the server answered), and each turn's output length (else output_len each)
    answers: list[str] = field(default_factory=list)
    turn_output_lens: list[int] = field(default_factory=list)
    think_time_s: float = 0.0       # a session waits this long after an answer before its next turn
    burst: int = -1                 # requests of one burst (>= 0) arrive together (burst_dataset)
    response_format: dict | None = None   # sent as the call's response_format (structured output)
    # a session sent as token ids: the ids before each answer (the first turn's prompt, then
    # what closes an answer and opens the next turn), and the dataset's answers' ids
    turn_ids: list[list[int]] = field(default_factory=list)
    answer_ids: list[list[int]] = field(default_factory=list)

    @property
    def is_session(self) -> bool:
        return bool(self.turns)

    @property
    def num_calls(self) -> int:
        return len(self.turns) or 1

    @property
    def output_tokens(self) -> int:
        return sum(self.turn_output_lens) if self.turn_output_lens else self.output_len * self.num_calls

    def turn_output_len(self, i: int) -> int:
        return self.turn_output_lens[i] if self.turn_output_lens else self.output_len


def words(r: random.Random, n: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(n))


def _as_prompt(ids: list[int], fmt: str, tokenizer) -> list[int] | str:
    if fmt == "ids":
        return ids
    if tokenizer is not None:
        return tokenizer.decode(ids, skip_special_tokens=True)
    return words(random.Random(ids[0] * 7919 + len(ids)), len(ids))


def random_dataset(workload: Workload, fmt: str = "ids", tokenizer=None) -> list[ServeRequest]:
    """The mixed-256 shape, drawn by the same generator as `qmigrate bench`: same ids, same lengths."""
    return [ServeRequest(_as_prompt(ids, fmt, tokenizer), n, prompt_len=len(ids))
            for ids, n in workload.requests()]


def shared_prefix_dataset(groups: int = 64, prompts_per_group: int = 16, system_len: int = 1024,
                          question_len: int = 128, output_len: int = 256, vocab: tuple[int, int] = (10, 31000),
                          seed: int = 1, fmt: str = "ids", tokenizer=None) -> list[ServeRequest]:
    """SGLang's generated-shared-prefix shape: per group a system prompt, per prompt a question."""
    r = random.Random(seed)
    out = []
    for _ in range(groups):
        system = [r.randint(*vocab) for _ in range(system_len)]
        for _ in range(prompts_per_group):
            ids = system + [r.randint(*vocab) for _ in range(question_len)]
            out.append(ServeRequest(_as_prompt(ids, fmt, tokenizer), output_len, prompt_len=len(ids)))
    return out


def burst_dataset(bursts: int = 16, per_burst: int = 48, prefix_len: int = 1024, suffix_len: int = 32,
                  output_len: tuple[int, int] = (512, 960), vocab: tuple[int, int] = (10, 31000), seed: int = 1,
                  fmt: str = "ids", tokenizer=None) -> list[ServeRequest]:
    """Bursts that placement at arrival cannot spread by what they will need: each burst is
    `per_burst` requests that share a `prefix_len`-token document, each with a question of its
    own and a long output drawn from `output_len`, all arriving at one instant. Placement that
    follows the prefix cache sends a burst to the worker that computed its document, and their
    outputs then grow in that worker's KV pool while the others have room."""
    r = random.Random(seed)
    out = []
    for b in range(bursts):
        doc = [r.randint(*vocab) for _ in range(prefix_len)]
        for _ in range(per_burst):
            ids = doc + [r.randint(*vocab) for _ in range(suffix_len)]
            out.append(ServeRequest(_as_prompt(ids, fmt, tokenizer), r.randint(*output_len), prompt_len=len(ids),
                                    burst=b))
    return out


def with_long_outputs(requests: list[ServeRequest], fraction: float, span: tuple[int, int], seed: int = 0,
                      max_model_len: int = 0) -> list[ServeRequest]:
    """A share `fraction` of the completions (drawn with `seed`) asking an output length from
    `span` instead of their own, e.g. a tenth of ShareGPT's requests answered at 2,048-4,096
    tokens; with max_model_len, no prompt and output together pass it."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"--long-output-fraction must be in [0, 1], got {fraction}")
    r = random.Random(seed)
    out = []
    for req in requests:
        if not req.is_session and r.random() < fraction:
            n = r.randint(*span)
            if max_model_len:
                n = min(n, max_model_len - max(req.prompt_len, 1))
                if n < 1:
                    raise ValueError(f"--max-model-len {max_model_len} leaves no room for output after a "
                                     f"prompt of {req.prompt_len} tokens")
            req = dataclasses.replace(req, output_len=n)
        out.append(req)
    return out


def multi_turn_dataset(sessions: int = 64, turns: int = 4, turn_len: int = 128, output_len: int = 128,
                       seed: int = 1, think_time_s: float = 0.0) -> list[ServeRequest]:
    """Sessions of `turns` user messages of about `turn_len` words each; every answer `output_len`
    tokens; a session waits think_time_s after an answer before its next turn."""
    r = random.Random(seed)
    return [ServeRequest("", output_len, turns=[words(r, turn_len) for _ in range(turns)], think_time_s=think_time_s)
            for _ in range(sessions)]


def sharegpt_dataset(num_requests: int, tokenizer, seed: int = 0, path: Path | None = None,
                     fmt: str = "text") -> list[ServeRequest]:
    """vLLM's ShareGPT sampling (bench/sharegpt.py): text prompts, or their ids."""
    from qmigrate.bench import sharegpt
    pairs = sharegpt.sample_pairs(sharegpt.read_conversations(path), tokenizer, num_requests, seed)
    return [ServeRequest(p.prompt_ids if fmt == "ids" else p.prompt, p.output_len, prompt_len=len(p.prompt_ids))
            for p in pairs]


SESSION_REPLIES = ("model", "dataset")


def sharegpt_sessions(num_sessions: int, tokenizer, max_turns: int = 8, think_time_s: float = 0.0, seed: int = 0,
                      path: Path | None = None, max_model_len: int = 0, replies: str = "model") -> list[ServeRequest]:
    """ShareGPT conversations as sessions: each turn carries the earlier turns and the replies to
    them, and asks for as many tokens as the dataset's reply to it has. replies: model (what the
    server answered, as a chat client sends back) or dataset (the dataset's replies, whatever the
    server answered). With max_model_len, a session ends before the turn whose prompt (the
    transcript's labels counted) and reply would pass it; else sessions stop at
    sharegpt.MAX_SESSION_TOKENS."""
    from qmigrate.bench import sharegpt
    if replies not in SESSION_REPLIES:
        raise ValueError(f"session replies must be {' or '.join(SESSION_REPLIES)}, not {replies!r}")
    limit = max_model_len - TRANSCRIPT_LABEL_TOKENS * max_turns if max_model_len else sharegpt.MAX_SESSION_TOKENS
    if limit < 2 * sharegpt.MIN_TOKENS:
        raise ValueError(f"--max-model-len {max_model_len} leaves no room for a session of {max_turns} turns")
    sessions = sharegpt.sample_sessions(sharegpt.read_conversations(path), tokenizer, num_sessions, max_turns, seed,
                                        limit)
    return [ServeRequest("", s.output_lens[0], turns=s.turns, answers=s.answers if replies == "dataset" else [],
                         turn_output_lens=s.output_lens, think_time_s=think_time_s) for s in sessions]


TRANSCRIPT_LABEL_TOKENS = 24   # a turn's "User: ", "\nAssistant:" and newline: 16 in the bench model's tokenizer, with room


def transcript(turns: list[str], answers: list[str]) -> str:
    """A session so far as one plain-text prompt: each user turn and the answer to it, ending
    where the answer to the last turn starts. Each call's prompt begins with the text of the
    one before and its answer, so a prefix cache finds the conversation as with chat."""
    return "".join(f"User: {turn}\nAssistant:" + (f"{answers[i]}\n" if i < len(answers) else "")
                   for i, turn in enumerate(turns))


REPLY_MARK = "\ue000reply-{}\ue000"   # where an answer goes in a rendered template (private-use characters)


def turn_pieces(turns: list[str], tokenizer) -> list[list[int]]:
    """The ids of a conversation's user turns as token-id prompts take them: the first turn's
    whole prompt, then for each later turn the ids from the end of the answer before it to
    where its own answer starts. Through the chat template where the tokenizer has one (the
    template's end of an answer, the next user turn, the opening of the assistant's), else as
    `transcript` writes them."""
    if not getattr(tokenizer, "chat_template", None):
        return [tokenizer.encode(f"User: {turns[0]}\nAssistant:")] + \
            [tokenizer.encode(f"\nUser: {turn}\nAssistant:", add_special_tokens=False) for turn in turns[1:]]
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i + 1 < len(turns):
            messages.append({"role": "assistant", "content": REPLY_MARK.format(i)})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pieces = []
    for i in range(len(turns) - 1):
        piece, found, text = text.partition(REPLY_MARK.format(i))
        if not found:
            raise ValueError("the chat template does not write an assistant's answer as it was given: "
                             "sessions cannot go as token ids")
        pieces.append(piece)
    return [tokenizer.encode(piece, add_special_tokens=False) for piece in [*pieces, text]]


def with_turn_ids(requests: list[ServeRequest], tokenizer) -> list[ServeRequest]:
    """Sessions to send as token ids (`turn_pieces`); the dataset's answers, where a session
    has them, as ids too."""
    for r in requests:
        if r.is_session:
            r.turn_ids = turn_pieces(r.turns, tokenizer)
            r.answer_ids = [tokenizer.encode(a, add_special_tokens=False) for a in r.answers]
    return requests


def jsonl_dataset(path: Path, default_output_len: int = 128) -> list[ServeRequest]:
    """One object a line: {"prompt": text or [ids], "output_len": N}, or {"turns": [text, ...], ...}."""
    out = []
    for no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{no}: not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{no}: each line must be a JSON object")
        n = obj.get("output_len", obj.get("max_tokens", default_output_len))
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{path}:{no}: output_len must be an integer >= 1")
        turns, prompt = obj.get("turns"), obj.get("prompt")
        if turns is not None:
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError(f"{path}:{no}: turns must be a non-empty list of strings")
            out.append(ServeRequest("", n, turns=list(turns)))
        elif isinstance(prompt, str) and prompt:
            out.append(ServeRequest(prompt, n))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         and t >= 0 for t in prompt):
            out.append(ServeRequest(list(prompt), n, prompt_len=len(prompt)))
        else:
            raise ValueError(f"{path}:{no}: give 'prompt' (text or a list of token ids) or 'turns'")
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


# A document that never closes within an output length: every structured call runs its whole length.
BUILTIN_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["notes"],
                  "properties": {"notes": {"type": "array", "minItems": 100_000,
                                           "items": {"type": "string", "maxLength": 24}}}}


def json_schema_format(source: str) -> dict:
    """OpenAI's response_format for a schema file, or 'builtin' (BUILTIN_SCHEMA)."""
    if source == "builtin":
        schema = BUILTIN_SCHEMA
    else:
        try:
            schema = json.loads(Path(source).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"--response-format-json-schema {source}: not JSON: {exc}") from None
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


def structure(requests: list[ServeRequest], response_format: dict, fraction: float) -> None:
    """Give `fraction` of the requests (spread evenly: the i-th when floor((i+1)f) > floor(if))
    the response_format; sessions keep none."""
    for i, r in enumerate(requests):
        if not r.is_session and int((i + 1) * fraction) > int(i * fraction):
            r.response_format = response_format

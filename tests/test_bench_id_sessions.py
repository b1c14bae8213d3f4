"""`bench serve --sessions-as ids`: multi-turn sessions as token ids, each turn the one before,
the ids the server returned for its answer and the next user turn, so that a prefix cache
finds the whole conversation so far whatever the model wrote."""

from __future__ import annotations

import math

import pytest

from qmigrate.bench import serve_data as D
from qmigrate.bench.serve import run_serve
from qmigrate.bench.serve_client import Client
from qmigrate.ingest.chat import encode_chat

pytestmark = pytest.mark.timeout(300)

BLOCK = 16   # the engine's default block_size: what a prefix cache finds is whole blocks


def _tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def _fail(message):
    raise AssertionError(message)


def test_turns_through_the_chat_template_and_as_plain_text(tiny_model_dir, tiny_chat_model_dir):
    chat = _tokenizer(tiny_chat_model_dir)
    turns = ["hello there", "how are you", "bye"]
    pieces = D.turn_pieces(turns, chat)
    # the first turn is what the chat endpoint makes of it; every later one closes an answer,
    # says the user's turn and opens the assistant's, as the template writes a conversation
    assert pieces[0] == encode_chat([{"role": "user", "content": turns[0]}], chat, _fail)
    answers = ["fine thanks", "ok then"]
    whole = encode_chat([{"role": "user", "content": turns[0]}, {"role": "assistant", "content": answers[0]},
                         {"role": "user", "content": turns[1]}, {"role": "assistant", "content": answers[1]},
                         {"role": "user", "content": turns[2]}], chat, _fail)
    joined = pieces[0] + chat.encode(answers[0], add_special_tokens=False) + pieces[1] + \
        chat.encode(answers[1], add_special_tokens=False) + pieces[2]
    assert chat.decode(joined) == chat.decode(whole)
    plain = _tokenizer(tiny_model_dir)
    pieces = D.turn_pieces(turns[:2], plain)
    joined = pieces[0] + plain.encode(answers[0], add_special_tokens=False) + pieces[1]
    assert plain.decode(joined, skip_special_tokens=True) == D.transcript(turns[:2], answers[:1])
    assert pieces[0][0] == plain.bos_token_id and plain.bos_token_id not in pieces[1]


def test_a_template_that_drops_an_answer_is_refused(tiny_chat_model_dir):
    tok = _tokenizer(tiny_chat_model_dir)
    tok.chat_template = "{% for m in messages if m['role'] == 'user' %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="as token ids"):
        D.turn_pieces(["a", "b"], tok)


def _recorded(monkeypatch) -> list[tuple]:
    """Every id call the client makes: (prompt, ids returned, its record), in order of ending."""
    calls = []
    original = Client.complete_ids

    async def recording(self, prompt, output_len, rec):
        ids = await original(self, prompt, output_len, rec)
        calls.append((list(prompt), ids, rec))
        return ids
    monkeypatch.setattr(Client, "complete_ids", recording)
    return calls


def _by_session(calls, requests) -> list[list[tuple]]:
    """The calls of each session in turn order (a session's first prompt starts its own)."""
    sessions = []
    for r in requests:
        mine = [c for c in calls if c[0][:len(r.turn_ids[0])] == r.turn_ids[0]]
        sessions.append(sorted(mine, key=lambda c: len(c[0])))
    return sessions


def test_each_turn_extends_the_one_before_and_the_cache_finds_it(http_node, tiny_chat_model_dir, monkeypatch):
    """Against a live node with the prefix cache: turn k's prompt is turn k-1's, the ids the
    server returned (as many as asked) and turn k's own ids; it finds cached every whole block
    of what the turn before ran (its prompt and its answer but the last token)."""
    tok = _tokenizer(tiny_chat_model_dir)
    requests = D.with_turn_ids(D.multi_turn_dataset(sessions=3, turns=3, turn_len=12, output_len=21), tok)
    calls = _recorded(monkeypatch)
    [(_, s)] = run_serve(base_url=http_node.url, model="tiny", requests=requests, rates=[math.inf], warmup=0,
                         sessions_as="ids")
    assert (s["completed"], s["failed"], s["short_calls"]) == (9, 0, 0), s
    for r, session in zip(requests, _by_session(calls, requests)):
        assert len(session) == 3
        prompt, ids, rec = session[0]
        assert prompt == r.turn_ids[0] and rec.cached_tokens == 0
        for k in (1, 2):
            before, answer = session[k - 1][0], session[k - 1][1]
            prompt, ids, rec = session[k]
            assert len(answer) == 21 and prompt == before + answer + r.turn_ids[k]
            assert rec.prompt_tokens == len(prompt)
            assert rec.cached_tokens == (len(before) + len(answer) - 1) // BLOCK * BLOCK, (k, len(before), rec)
    later, found = s["later_turns"], [c for c in calls if c[2].turn > 0]
    assert later["calls"] == 6 and later["prefix_hit_rate"] > 0.6
    assert later["earlier_hit_rate"] == pytest.approx(sum(c[2].cached_tokens for c in found) /
                                                      sum(c[2].earlier_tokens for c in found))
    assert all(c[2].earlier_tokens == len(c[0]) - len(r.turn_ids[c[2].turn]) for r, session in
               zip(requests, _by_session(calls, requests)) for c in session)


def test_with_the_datasets_replies_each_turn_carries_them(http_node, tiny_chat_model_dir, monkeypatch):
    tok = _tokenizer(tiny_chat_model_dir)
    session = D.ServeRequest("", 4, turns=["one two", "three four", "five"], answers=["six", "seven eight", "x"],
                             turn_output_lens=[4, 5, 3])
    [r] = D.with_turn_ids([session], tok)
    assert r.answer_ids == [tok.encode(a, add_special_tokens=False) for a in r.answers]
    calls = _recorded(monkeypatch)
    [(_, s)] = run_serve(base_url=http_node.url, model="tiny", requests=[r], rates=[math.inf], warmup=1,
                         sessions_as="ids")
    assert (s["completed"], s["short_calls"], s["output_tokens"]) == (3, 0, 12), s
    assert len(calls) == 4 and calls[0][0] == r.turn_ids[0]   # the warm-up's one turn, then the session's
    prompts = [c[0] for c in calls[1:]]
    assert prompts[0] == r.turn_ids[0] and prompts[1] == prompts[0] + r.answer_ids[0] + r.turn_ids[1]
    assert prompts[2] == prompts[1] + r.answer_ids[1] + r.turn_ids[2]


def test_sessions_as_ids_need_their_ids_and_a_tokenizer(qmigrate, tiny_model_dir):
    sessions = D.multi_turn_dataset(sessions=1, turns=2, turn_len=3, output_len=2)
    with pytest.raises(ValueError, match="turn's ids"):
        run_serve(base_url="http://127.0.0.1:9", model="m", requests=sessions, rates=[1.0], sessions_as="ids")
    run = qmigrate("bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", "multi-turn",
                   "--sessions-as", "ids")
    assert run.returncode != 0 and "--sessions-as ids needs --tokenizer" in run.stderr


def test_ids_sessions_run_from_several_client_processes(http_node, tiny_chat_model_dir):
    tok = _tokenizer(tiny_chat_model_dir)
    requests = D.with_turn_ids(D.multi_turn_dataset(sessions=2, turns=2, turn_len=20, output_len=40), tok)
    [(_, s)] = run_serve(base_url=http_node.url, model="tiny", requests=requests, rates=[math.inf], warmup=0,
                         sessions_as="ids", processes=2)
    assert (s["completed"], s["failed"], s["short_calls"]) == (4, 0, 0), s
    # every whole block of the turn before was found: its prompt and its answer but the last token
    earlier = [len(r.turn_ids[0]) + 40 for r in requests]
    assert s["later_turns"]["earlier_hit_rate"] == pytest.approx(sum((n - 1) // BLOCK * BLOCK for n in earlier)
                                                                 / sum(earlier))

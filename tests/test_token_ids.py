"""`return_token_ids` (vLLM's): the prompt's ids and the ids each choice was made of, beside its
text, on both endpoints, streamed and whole, with several choices, and after a sequence moved
between workers; the ids travel from the detokenizer to ingest only for requests that ask."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import helpers as H
from qmigrate.detokenizer.formats import make_sink
from qmigrate.ingest.handoff import http_route, reply_rows, rows_of, split_by_front, front_base
from qmigrate.ingest.openai_api import ApiError, fan_out, parse_body
from qmigrate.ingest.prompts import PromptError, parse_line
from qmigrate.wire import codec
from qmigrate.wire import protocol as P

pytestmark = pytest.mark.timeout(300)


def _tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def test_the_flag_is_a_boolean_and_routes_each_choice_back_with_its_ids(tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    _parse = lambda body: parse_body({"model": "m", **body}, "completion", model_names=["m"], tokenizer=tok,
                                     max_context=512)
    for value in (1, "true", [True]):
        with pytest.raises(ApiError) as err:
            _parse({"prompt": [5, 6], "return_token_ids": value})
        assert err.value.status == 400 and err.value.param == "return_token_ids"
        with pytest.raises(PromptError) as refused:   # stdin JSONL refuses the same, naming the field
            parse_line(f'{{"prompt_ids": [5, 6], "return_token_ids": {json.dumps(value)}}}', mode="jsonl",
                       line_no=1, tokenizer=tok, max_context=512)
        assert refused.value.param == "return_token_ids" and refused.value.message == err.value.message
    # there it is taken (its final record carries "token_ids" either way)
    assert parse_line('{"prompt_ids": [5, 6], "return_token_ids": true}', mode="jsonl", line_no=1, tokenizer=tok,
                      max_context=512).return_token_ids
    req = _parse({"prompt": [[5, 6], [7]], "n": 2, "return_token_ids": True})
    assert req.return_token_ids and req.has_extras
    choices = fan_out(req, "cmpl-1")
    assert len(choices) == 4 and all(http_route(p) == P.ROUTE_INGEST_IDS for p in choices)
    plain = fan_out(_parse({"prompt": [5, 6]}), "cmpl-2")
    assert [http_route(p) for p in plain] == [P.ROUTE_INGEST] and not _parse({"prompt": [5]}).has_extras


def _replies(rows: list[tuple], ids: list[list[int] | None]) -> P.Replies:
    seq_ids, texts, finish, counts = zip(*rows)
    msg = P.Replies(P.pack_i64(seq_ids), P.pack_u8(finish), P.pack_i32(counts), list(texts))
    return P.replies_with_ids(msg, ids) if any(x is not None for x in ids) else msg


def test_replies_carry_ids_per_row_checked_at_decode_and_split_with_their_rows():
    a, b = front_base(1 << 40, 0) | 1, front_base(1 << 40, 1) | 2
    msg = _replies([(a, "x", 0, 2), (b, "y", 0, 1), (a, "", int(P.Finish.LENGTH), 3)], [[11, 12], None, [13]])
    back = codec.decode(codec.encode(msg))
    rows = reply_rows(back)
    assert [row[7] for row in rows] == [[11, 12], [], [13]] and [row[:4] for row in rows] == \
        [(a, "x", 0, 2), (b, "y", 0, 1), (a, "", int(P.Finish.LENGTH), 3)]
    parts = split_by_front(back)
    assert [row[7] for row in reply_rows(parts[0])] == [[11, 12], [13]]
    assert [row[7] for row in reply_rows(parts[1])] == [[]]
    assert [row[7] for row in reply_rows(rows_of(back, np.array([2])))] == [[13]]
    assert all(len(row) == 5 for row in reply_rows(_replies([(a, "x", 0, 1)], [None])))   # none asked: none travel
    for counts, ids in (([2], [1, 2, 3]), ([1, 1], [4, 5]), ([-1, 1, 0], [])):
        bad = P.Replies(P.pack_i64([a, b, a]), P.pack_u8([0] * 3), P.pack_i32([1] * 3), ["", "", ""],
                        id_counts=P.pack_i32(counts), token_ids=P.pack_i32(ids))
        with pytest.raises(P.ProtocolError, match="id_counts"):
            codec.decode(codec.encode(bad))


def test_a_sink_sends_each_id_once_in_order_however_the_tokens_arrive(tiny_model_dir):
    """A move resends tokens from an index the detokenizer may already have, and a gap can
    come before what fills it: the ids a request gets are its tokens, each once, in order."""
    tok = _tokenizer(tiny_model_dir)
    replies = []
    sink = make_sink("jsonl", tok, lambda text: None, reply=lambda *row: replies.append(row))
    sink.start(1, "r1", [1, 5, 6], route=P.ROUTE_INGEST_IDS)
    sink.start(2, "r2", [1, 5, 6], route=P.ROUTE_INGEST)
    tokens = [40, 41, 42, 43, 44, 45]
    for sid in (1, 2):
        sink.tokens(sid, 0, tokens[:2])
        sink.tokens(sid, 3, tokens[3:5])     # a gap: waits for index 2
        sink.tokens(sid, 1, tokens[1:4])     # resent from index 1 (a move), filling the gap
        sink.tokens(sid, 5, tokens[5:])
        sink.finish(sid, "length", 6)
    mine = [row for row in replies if row[0] == 1]
    assert [t for row in mine if len(row) > 7 and row[7] for t in row[7]] == tokens
    assert mine[-1][2] == P.Finish.LENGTH and mine[-1][3] == 6
    assert all(len(row) <= 7 or row[7] is None for row in replies if row[0] == 2)


# --- the official client on a live node --------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from conftest import greedy_reference
    return greedy_reference(tiny_model_dir)


def _stream(client, kind: str, **args) -> tuple[dict, list]:
    """A stream's choices: index -> {"ids", "prompt_ids", "text"}; and its raw chunks."""
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    out, chunks = {}, []
    for chunk in create(stream=True, **args):
        chunks.append(chunk)
        top = (chunk.model_extra or {}).get("prompt_token_ids")
        for choice in chunk.choices:
            extra = choice.model_extra or {}
            got = out.setdefault(choice.index, {"ids": [], "prompt_ids": [], "text": ""})
            got["ids"] += extra.get("token_ids") or []
            for prompt_ids in (extra.get("prompt_token_ids"), top):
                if prompt_ids is not None:
                    got["prompt_ids"].append(prompt_ids)
            got["text"] += (choice.delta.content or "") if kind == "chat" else choice.text
    return out, chunks


def test_completions_return_the_ids_the_model_generated_streamed_and_whole(http_node, reference):
    client = http_node.client
    prompt = [1, 17, 99, 5, 42, 250, 7]
    args = dict(model="tiny", prompt=prompt, max_tokens=12, extra_body={"return_token_ids": True})
    whole = client.completions.create(**args)
    choice = whole.choices[0].model_extra
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == whole.usage.completion_tokens > 1
    reference(prompt, 12, choice["token_ids"], "whole")
    streamed, chunks = _stream(client, "completion", **args)
    assert streamed[0]["ids"] == choice["token_ids"] and streamed[0]["prompt_ids"] == [prompt]
    assert streamed[0]["text"] == whole.choices[0].text
    assert "token_ids" in (chunks[0].choices[0].model_extra or {})
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)   # not asked: not sent
    assert "token_ids" not in (plain.choices[0].model_extra or {})


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_and_choices_each_get_their_own_ids(http_node, reference, stream):
    prompts = [[1, 30, 31, 32], [1, 60, 61]]
    args = dict(model="tiny", prompt=prompts, n=2, max_tokens=10, seed=5, temperature=0.0,
                extra_body={"return_token_ids": True})
    if stream:
        got, _ = _stream(http_node.client, "completion", **args)
        choices = [got[i] for i in range(4)]
        assert all(c["prompt_ids"] == [prompts[i // 2]] for i, c in enumerate(choices))
    else:
        out = http_node.client.completions.create(**args)
        choices = [{"ids": c.model_extra["token_ids"], "prompt_ids": [c.model_extra["prompt_token_ids"]]}
                   for c in out.choices]
        assert [c["prompt_ids"] for c in choices] == [[prompts[i // 2]] for i in range(4)]
    for i, c in enumerate(choices):
        reference(prompts[i // 2], 10, c["ids"], f"choice {i}")


@pytest.mark.parametrize("n", [1, 2])
def test_chat_returns_the_rendered_prompts_ids_and_each_choices(http_node, tiny_chat_model_dir, reference, n):
    tok = _tokenizer(tiny_chat_model_dir)
    messages = [{"role": "user", "content": "Say something."}]
    rendered = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    args = dict(model="tiny", messages=messages, max_tokens=9, n=n, extra_body={"return_token_ids": True})
    whole = http_node.client.chat.completions.create(**args)
    assert whole.model_extra["prompt_token_ids"] == rendered
    streamed, chunks = _stream(http_node.client, "chat", **args)
    for i in range(n):
        ids = whole.choices[i].model_extra["token_ids"]
        assert len(ids) == whole.usage.completion_tokens // n and streamed[i]["ids"] == ids and streamed[i]["prompt_ids"] == [rendered]
        reference(rendered, 9, ids, f"chat choice {i}")
        assert streamed[i]["text"] == whole.choices[i].message.content


def test_ids_after_a_forced_migration_are_those_of_one_worker(tmp_path, ipc_dir, tiny_model_dir, reference):
    """Two workers; w1 is paused holding requests it has not run, then drained, so every one
    of them moves (helpers.migrate_by_drain); each still gets the ids greedy generate() gives."""
    import openai
    port = H.free_port()
    path = tmp_path / "topo.yaml"
    address = H.fleet_topology(path, tiny_model_dir, 2, ipc_dir=ipc_dir, worker={"max_num_seqs": 4},
                               router={"max_lease_steps": 2, "heartbeat_timeout_s": 30.0, "lease_timeout_s": 60.0},
                               ingest={"http_port": port, "model_name": "tiny"})
    nodes = H.Nodes(tmp_path)
    from conftest import greedy_tokens_many
    rng = np.random.default_rng(3)
    prompts = [[1] + [int(t) for t in rng.integers(3, 1400, 5 + i)] for i in range(12)]
    # each runs past a lease's steps, so that one leased to w1 before the drain is unfinished then
    prompts = [p for p, ids in zip(prompts, greedy_tokens_many(tiny_model_dir, [(p, 24) for p in prompts]))
               if len(ids) > 8][:6]
    assert len(prompts) >= 4
    got: dict[int, object] = {}
    try:
        head = nodes.start(path, "head")
        H.wait_for("both workers", lambda s: s.get("workers") == 2, address)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(i: int) -> None:
            try:
                args = dict(model="tiny", prompt=prompts[i], max_tokens=24, extra_body={"return_token_ids": True})
                got[i] = _stream(client, "completion", **args)[0][0]["ids"] if i % 2 else \
                    client.completions.create(**args).choices[0].model_extra["token_ids"]
            except Exception as exc:  # noqa: BLE001 -- reported by the assert below
                got[i] = exc

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        H.migrate_by_drain(head, address, "w1", lambda: [t.start() for t in threads])
        for t in threads:
            t.join(120)
        stats = H.stats(address)
    finally:
        nodes.stop_all()
    assert stats.get("migrations_drain", 0) > 0, stats
    for i, prompt in enumerate(prompts):
        assert isinstance(got.get(i), list), got.get(i)
        reference(prompt, 24, got[i], f"request {i}")


def test_ids_past_the_tokenizer_are_taken_up_to_the_models_embedding_rows(tiny_model_dir, tmp_path):
    """A model can emit any id its embedding has (a padded vocabulary, a shape served with a
    smaller tokenizer); a client sending its output back as ids is refused only past those."""
    import shutil
    from qmigrate.hub.tokenizer_info import load_tokenizer_info, token_id_bound
    tok = _tokenizer(tiny_model_dir)
    n = len(tok)
    model = tmp_path / "wide"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": n + 500}))
    assert token_id_bound(tiny_model_dir, tok) == n
    assert token_id_bound(model, load_tokenizer_info(model)[0]) == n + 500
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {"vocab_size": n + 7}}))
    assert token_id_bound(nested, tok) == n + 7
    (nested / "config.json").write_text(json.dumps({"vocab_size": n - 100}))   # fewer rows: the tokenizer's ids
    assert token_id_bound(nested, tok) == n

    _parse = lambda vocab, ids: parse_body({"model": "m", "prompt": ids}, "completion", model_names=["m"],
                                           tokenizer=tok, max_context=4096, vocab_size=vocab)
    assert _parse(n + 500, [5, n, n + 499]).prompt.prompt_ids == [5, n, n + 499]
    for vocab, ids in ((n + 500, [5, n + 500]), (None, [5, n])):
        with pytest.raises(ApiError) as err:
            _parse(vocab, ids)
        assert err.value.status == 400 and err.value.param == "prompt" and "out of range" in err.value.message
    line = json.dumps({"prompt_ids": [5, n + 3]})
    assert parse_line(line, mode="jsonl", line_no=1, tokenizer=tok, max_context=4096,
                      vocab_size=n + 500).prompt_ids == [5, n + 3]

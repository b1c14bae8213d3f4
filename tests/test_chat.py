"""Chat input at ingest: "messages" in JSONL, --chat for text lines, cancel lines."""

from __future__ import annotations

import copy
import json

import pytest

from conftest import CHAT_TEMPLATE
from qmigrate.ingest.prompts import CancelRequest, PromptError, parse_line
from tokenizer_util import build_tokenizer


@pytest.fixture(scope="module")
def chat_tok():
    tok = copy.deepcopy(build_tokenizer())  # build_tokenizer() is shared: keep it template-free
    tok.chat_template = CHAT_TEMPLATE
    return tok


def parse(tok, obj, mode="jsonl", **kw):
    line = obj if isinstance(obj, str) else json.dumps(obj)
    return parse_line(line, mode=mode, line_no=4, tokenizer=tok, max_context=kw.pop("max_context", 256), **kw)


def test_messages_go_through_the_chat_template(chat_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    p = parse(chat_tok, {"id": "c1", "messages": messages, "max_new_tokens": 5})
    expected = chat_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert expected == "<s><|system|>Be brief.\n<|user|>Hello\n<|assistant|>"
    assert p.req_id == "c1" and p.max_new_tokens == 5
    assert p.prompt_ids == chat_tok.encode(expected, add_special_tokens=False)
    assert p.prompt_ids.count(chat_tok.bos_token_id) == 1  # the template's BOS, none added


def test_text_parts_are_joined(chat_tok):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    p = parse(chat_tok, {"messages": [{"role": "user", "content": parts}]})
    assert p.prompt_ids == parse(chat_tok, {"messages": [{"role": "user", "content": "Hello"}]}).prompt_ids


def test_chat_text_mode_makes_each_line_a_user_message(chat_tok):
    p = parse(chat_tok, "Hello there\n", mode="text", chat=True)
    jsonl = parse(chat_tok, {"messages": [{"role": "user", "content": "Hello there"}]})
    assert p.req_id == "4" and p.prompt_ids == jsonl.prompt_ids


def test_a_model_without_a_chat_template_is_a_per_request_error():
    tok = build_tokenizer()
    assert not tok.chat_template
    for obj, mode in ([{"id": "x", "messages": [{"role": "user", "content": "hi"}]}, "jsonl"], ["hi", "text"]):
        with pytest.raises(PromptError, match="no chat template") as info:
            parse(tok, obj, mode=mode, chat=True)
    assert info.value.req_id == "4"


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], r"'messages\[0\]' must be an object"),
    ([{"role": "wizard", "content": "x"}], r"'messages\[0\].role' must be one of"),
    ([{"role": "user"}], r"'messages\[0\].content' must be a string"),
    ([{"role": "user", "content": 5}], r"'messages\[0\].content' must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ([{"role": "assistant", "content": "x", "tool_calls": 3}], "'messages\\[0\\].tool_calls' must be a list"),
    ([{"role": "user", "content": "x", "audio": []}], "unsupported key 'audio'"),
])
def test_bad_messages_are_clear_errors(chat_tok, messages, message):
    with pytest.raises(PromptError, match=message):
        parse(chat_tok, {"id": "m", "messages": messages})


def test_messages_with_prompt_is_an_error(chat_tok):
    with pytest.raises(PromptError, match="exactly one of"):
        parse(chat_tok, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]})


def test_a_chat_prompt_over_the_context_is_an_error(chat_tok):
    with pytest.raises(PromptError, match="the model's context is 8"):
        parse(chat_tok, {"messages": [{"role": "user", "content": "The quick brown fox " * 5}]}, max_context=8)


def test_cancel_lines(chat_tok):
    assert parse(chat_tok, {"cancel": "q1"}) == CancelRequest("q1")
    assert parse(chat_tok, {"cancel": 7}) == CancelRequest("7")
    with pytest.raises(PromptError, match="'cancel' must name"):
        parse(chat_tok, {"cancel": ""})
    with pytest.raises(PromptError, match="'cancel' is an unrecognized request argument"):
        parse(chat_tok, {"cancel": "q1", "prompt": "x"})

"""Tool calling: the request's tools and choice, the three parsers, the grammar that forces a call,
and the official client's forced calls (streamed and not) on a random-weight model."""

from __future__ import annotations

import json

import llguidance
import pytest
jsonschema = pytest.importorskip("jsonschema")   # the test extra; absent where only the GPU tests run

from qmigrate.ingest import tools as T
from qmigrate.ingest.chat import encode_chat
from qmigrate.ingest.prompts import PromptError

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 6}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _tools(parser="hermes", **body):
    return T.parse_tools({"tools": TOOLS, **body}, parser)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(body, param):
    with pytest.raises(T.ToolError) as err:
        T.parse_tools(body, "hermes")
    assert err.value.param == param


def test_the_parser_comes_from_the_chat_template_unless_named():
    assert T.parser_of("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert T.parser_of("auto", "{{ '<|python_tag|>' }}") == "llama3_json"
    assert T.parser_of("auto", "{{ '<tool_call>' }}") == "hermes"
    assert T.parser_of("mistral", "{{ '<tool_call>' }}") == "mistral"


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),   # the marker was a special token
])
def test_each_parser_finds_the_calls_and_the_streamed_form_holds_them_back(parser, text):
    tools = _tools(parser)
    content, calls = T.parse_calls(text, tools)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2
    assert content == ("Let me look." if parser == "hermes" else None)
    one = T.parse_calls(text, _tools(parser, parallel_tool_calls=False))[1]
    assert [c.name for c in one] == ["get_weather"]
    stream = T.CallStream(tools)
    shown = "".join(stream.push(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, streamed = stream.finish()
    assert (shown + rest).strip() == (content or "") and [c.name for c in streamed] == ["get_weather", "get_time"]
    plain = T.CallStream(tools)
    said = "".join(plain.push(piece) for piece in ("Hello", " there", ", no calls <b>here</b>"))
    assert said + plain.finish()[0] == "Hello there, no calls <b>here</b>" and not plain.finish()[1]


@pytest.mark.parametrize("parser", T.PARSERS)
def test_the_forced_grammar_takes_calls_of_the_tools_only(parser, tiny_chat_model_dir):
    from qmigrate.hub.tokenizer_info import load_tokenizer_info
    import llguidance.hf
    tokenizer = load_tokenizer_info(tiny_chat_model_dir)[0]
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    args = "parameters" if parser == "llama3_json" else "arguments"
    good = {"name": "get_weather", args: {"city": "Lima", "unit": "f"}}
    wrap = {"hermes": lambda o: f"<tool_call>\n{json.dumps(o)}\n</tool_call>", "llama3_json": json.dumps,
            "mistral": lambda o: f"[TOOL_CALLS][{json.dumps(o)}]"}[parser]

    def takes(tools, text):
        m = llguidance.LLMatcher(lltok, llguidance.grammar_from("grammar", T.forced_grammar(tools)))
        return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert takes(_tools(parser, tool_choice="required"), wrap(good))
    assert not takes(_tools(parser, tool_choice="required"), wrap({**good, "name": "get_news"}))
    assert not takes(_tools(parser, tool_choice="required"), wrap({**good, args: {"city": "Rome", "unit": "f"}}))
    named = _tools(parser, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert not takes(named, wrap(good))
    assert takes(named, wrap({"name": "get_time", args: {"zone": "UTC"}}))


TOOL_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
                 "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                 "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
                 "{% endfor %}{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}assistant:")


def test_tools_and_a_conversation_of_calls_reach_the_chat_template(tiny_chat_model_dir):
    from qmigrate.hub.tokenizer_info import load_tokenizer_info
    tokenizer = load_tokenizer_info(tiny_chat_model_dir)[0]
    tokenizer.chat_template = TOOL_TEMPLATE
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}]

    def fail(message):
        raise PromptError("r", message)
    text = tokenizer.decode(encode_chat(messages, tokenizer, fail, tools=TOOLS))
    assert "TOOLS: get_weather get_time" in text and "[call get_weather Oslo]" in text and "4 C (call_1)" in text
    with pytest.raises(PromptError, match="tool_calls"):
        encode_chat([{"role": "assistant", "content": "", "tool_calls": [{"function": 3}]}], tokenizer, fail)


# --- the official client -----------------------------------------------------------------------

def _check(calls, only=None):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_required_call_is_a_tool_call_that_validates(http_node):
    client = http_node.client
    for seed in range(3):
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required",
            max_tokens=150, temperature=1.0, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _check(choice.message.tool_calls)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=5)
    assert len(out.choices[0].message.tool_calls) == 1


def test_a_named_call_streams_as_deltas_the_client_assembles(http_node):
    client = http_node.client
    history = [{"role": "user", "content": "Time?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
               {"role": "tool", "tool_call_id": "call_a", "content": "12:00"},
               {"role": "user", "content": "And the weather?"}]
    with client.chat.completions.stream(model="tiny", messages=history, tools=TOOLS, max_tokens=150, seed=1,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=1.0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    _check(final.choices[0].message.tool_calls, "get_weather")


def test_tool_choice_none_and_auto_answer_with_text_or_calls(http_node):
    client = http_node.client
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                         tool_choice="none", max_tokens=8)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                         max_tokens=8)
    choice = out.choices[0]
    assert choice.message.tool_calls is None or choice.finish_reason == "tool_calls"

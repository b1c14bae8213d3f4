"""A conversation through the model's chat template (pure): OpenAI's messages, with tools
and tool calls, as the prompt's token ids."""

from __future__ import annotations

import json

from qmigrate.hub.tokenizer_info import max_token_chars

CHAT_ROLES = frozenset(["system", "user", "assistant", "developer", "tool"])
MESSAGE_KEYS = frozenset(["role", "content", "name", "tool_calls", "tool_call_id"])


def check_chars(num_chars: int, tokenizer, max_context: int, fail) -> None:
    """Refuse a text that is surely longer than the context before tokenizing it: a prompt
    near the body limit costs a tokenizer most of a second and hundreds of MiB."""
    per_token = max_token_chars(tokenizer)
    if num_chars > max_context * per_token:
        fail(f"prompt is at least {-(-num_chars // per_token)} tokens ({num_chars} characters, at most "
             f"{per_token} a token); the model's context is {max_context}")


def encode_chat(messages, tokenizer, fail, add_generation_prompt: bool = True,
                max_context: int | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation through the model's chat template, the assistant's turn
    opened (unless not `add_generation_prompt`). The template writes any special tokens
    itself (BOS included), so none are added. With `max_context`, messages whose text alone
    is surely longer are refused untokenized. `tools` (OpenAI's tool objects) go to the
    template too; assistant turns may carry `tool_calls`, and `tool` turns a `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        fail("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    turns = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            fail(f"'messages[{i}]' must be an object with 'role' and 'content'")
        unknown = sorted(set(msg) - MESSAGE_KEYS)
        if unknown:
            fail(f"'messages[{i}]' has an unsupported key {unknown[0]!r}")
        role, content = msg.get("role"), msg.get("content")
        if role not in CHAT_ROLES:
            fail(f"'messages[{i}].role' must be one of {', '.join(sorted(CHAT_ROLES))}")
        if isinstance(content, list):  # OpenAI's content parts; text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                fail(f"'messages[{i}].content': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
            content = "".join(p["text"] for p in content)
        calls = msg.get("tool_calls")
        if content is None and role == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            fail(f"'messages[{i}].content' must be a string")
        turn = {"role": role, "content": content}
        if calls is not None:
            turn["tool_calls"] = _template_calls(calls, i, fail)
        if isinstance(msg.get("tool_call_id"), str):
            turn["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            turn["name"] = msg["name"]
        turns.append(turn)
    if not getattr(tokenizer, "chat_template", None):
        fail("this model has no chat template; send a plain prompt instead of messages")
    if max_context is not None:  # the template only adds text
        check_chars(sum(len(turn["content"]) for turn in turns), tokenizer, max_context, fail)
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **({"tools": tools} if tools else {}))
    except Exception as exc:  # noqa: BLE001 -- a template may raise anything (jinja, raise_exception)
        fail(f"the chat template refused these messages: {exc}")
    return list(tokenizer.encode(text, add_special_tokens=False))


def _template_calls(calls, i: int, fail) -> list[dict]:
    """An assistant turn's tool calls as templates read them: arguments as an object."""
    if not isinstance(calls, list):
        fail(f"'messages[{i}].tool_calls' must be a list of tool calls")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            fail(f"'messages[{i}].tool_calls' must hold {{\"id\", \"type\": \"function\", \"function\": "
                 "{\"name\", \"arguments\"}}}")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out

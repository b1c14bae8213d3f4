"""Tool calling (pure): a chat request's `tools` and `tool_choice`, the grammar that forces a
call, and the parsers that find calls in a model's text.

The model writes calls in its family's format; which one is the `tool_call_parser` setting
(`--tool-call-parser`), or by default the one its chat template names:
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
               (Hermes, Qwen2.5 and most templates);
  llama3_json  `{"name": ..., "parameters": {...}}`, calls separated by `; ` (Llama 3.1/3.2);
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is a special
               token: the text may begin at the list).
`tool_choice` "auto" parses whatever the model wrote; "required" and a named function force a
call with a grammar of that format over the tools' parameter schemas (hub/grammars.py's JSON
options), so the arguments validate against them; "none" parses nothing.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral")
CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class Tools:
    functions: list[dict]            # {"name", "description", "parameters"} of each tool
    choice: str = "auto"             # none, auto, required, or "function" (forced: `name`)
    name: str = ""                   # the function tool_choice names
    parallel: bool = True
    parser: str = "hermes"
    calls_expected: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.calls_expected = self.choice != "none" and bool(self.functions)

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]


def parse_tools(body: dict, parser: str) -> Tools | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` of a chat body; None without tools."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                            "\"description\", \"parameters\"}}}}", f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"'tools[{i}].function.parameters' must be a JSON schema object",
                            f"tools[{i}].function.parameters")
        functions.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("'tools' names a function twice", "tools")
    if choice is None:
        choice = "auto" if functions else "none"
    name = ""
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ToolError("'tool_choice' must name one of the request's tools: {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", "tool_choice")
        choice = "function"
    elif choice not in CHOICES:
        raise ToolError("'tool_choice' must be none, auto, required or {\"type\": \"function\", ...}",
                        "tool_choice")
    if choice in ("required",) and not functions:
        raise ToolError("'tool_choice' required needs 'tools'", "tool_choice")
    if not functions:
        return None
    return Tools(functions, choice, name, parallel, parser)


def parser_of(setting: str, chat_template: str | None) -> str:
    """The parser a setting names ("auto": the one the model's chat template writes)."""
    if setting != "auto":
        return setting
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def _call_schema(tools: Tools) -> dict:
    fns = [f for f in tools.functions if tools.choice != "function" or f["name"] == tools.name]
    args = "parameters" if tools.parser == "llama3_json" else "arguments"
    return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", args],
                       "properties": {"name": {"const": f["name"]}, args: f["parameters"]}} for f in fns],
            "x-guidance": _JSON_OPTIONS}


def forced_grammar(tools: Tools) -> str:
    """A Lark grammar (llguidance's, with %json) of one call, or several with parallel calls,
    in the parser's format."""
    one = json.dumps(_call_schema(tools))
    many = tools.parallel and tools.choice == "required"
    if tools.parser == "hermes":
        rules = 'call: "<tool_call>\\n" obj "\\n</tool_call>"\n'
        start = 'start: call ("\\n" call)*\n' if many else "start: call\n"
    elif tools.parser == "llama3_json":
        rules = "call: obj\n"
        start = 'start: call ("; " call)*\n' if many else "start: call\n"
    else:
        rules = "call: obj\n"
        start = 'start: "[TOOL_CALLS][" call (", " call)* "]"\n' if many else 'start: "[TOOL_CALLS][" call "]"\n'
    return "%llguidance {}\n" + start + rules + "obj: %json " + one + "\n"


@dataclass(slots=True)
class Call:
    name: str
    arguments: str                   # JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _objects(text: str) -> list[dict]:
    """The JSON values at the start of `text` and after each separator (`;`, `,`, whitespace)."""
    out, decoder, i = [], json.JSONDecoder(), 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            break
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        out.extend(value if isinstance(value, list) else [value])
    return out


def parse_calls(text: str, tools: Tools) -> tuple[str | None, list[Call]]:
    """(content, calls) of a finished output: the text before the calls (None when empty), and
    each call whose name is one of the tools; no calls (content the whole text) when none parse."""
    names = {f["name"] for f in tools.functions}
    args = "parameters" if tools.parser == "llama3_json" else "arguments"
    if tools.parser == "hermes":
        found = [m for m in _HERMES.finditer(text)]
        content = text[:found[0].start()] if found else text
        values = []
        for m in found:
            values.extend(_objects(m.group(1)))
    elif tools.parser == "mistral":
        at = text.find("[TOOL_CALLS]")
        body = text[at + len("[TOOL_CALLS]"):] if at >= 0 else text.lstrip()
        content = text[:at] if at >= 0 else ""
        values = _objects(body) if at >= 0 or body.startswith("[") else []
        if not values:
            content = text
    else:
        stripped = text.lstrip().removeprefix("<|python_tag|>")
        values = _objects(stripped) if stripped.startswith("{") else []
        content = "" if values else text
    calls = []
    for v in values:
        if isinstance(v, dict) and v.get("name") in names:
            arguments = v.get(args, v.get("arguments", v.get("parameters", {})))
            calls.append(Call(v["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if not calls:
        return text, []
    if not tools.parallel:
        calls = calls[:1]
    return (content.strip() or None), calls


def may_hold_calls(text: str, tools: Tools) -> bool:
    """Whether a stream's text so far may be (the start of) calls: held back until the end."""
    s = text.lstrip()
    if tools.is_forced:
        return True
    if tools.parser == "hermes":
        return "<tool_call>" in text or "<tool_call>".startswith(s[:11]) and bool(s) and s[0] == "<"
    if tools.parser == "mistral":
        return s.startswith("[") or "[TOOL_CALLS]".startswith(s) and bool(s)
    return s.startswith("{") or s.startswith("<|python_tag|>")


def message_calls(calls: list[Call]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def delta_calls(calls: list[Call]) -> list[list[dict]]:
    """Each call's stream deltas: index, id, type and name with empty arguments first, then the
    arguments (OpenAI's shape, which the official client's stream assembles)."""
    out = []
    for i, c in enumerate(calls):
        out.append([{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}])
        out.append([{"index": i, "function": {"arguments": c.arguments}}])
    return out


_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}


class CallStream:
    """A streamed choice's text with its calls held back: `push` gives the text that is surely
    content, `finish` the rest as (content, calls) once the output has ended."""

    def __init__(self, tools: Tools) -> None:
        self.tools, self.text, self.sent = tools, "", 0
        self.state = "hold" if tools.is_forced else "open"   # open, content (no calls can come), hold

    def push(self, text: str) -> str:
        self.text += text
        if self.state == "hold":
            return ""
        rest = self.text[self.sent:]
        if self.state == "content":
            self.sent = len(self.text)
            return rest
        marker = _MARKERS[self.tools.parser]
        if self.tools.parser == "hermes":   # calls may follow content: hold from a '<' that may begin one
            at = rest.find("<")
            while at >= 0 and not (rest[at:].startswith(marker) or marker.startswith(rest[at:])):
                at = rest.find("<", at + 1)
            if at >= 0 and rest[at:].startswith(marker):
                self.state = "hold"
            cut = len(rest) if at < 0 else at
            self.sent += cut
            return rest[:cut]
        s = self.text.lstrip()              # the others: calls only at the start
        if not s or marker.startswith(s):
            return ""
        if s.startswith(marker) or s[0] == ("[" if self.tools.parser == "mistral" else "{"):
            self.state = "hold"
            return ""
        self.state = "content"
        self.sent = len(self.text)
        return rest

    def finish(self) -> tuple[str, list[Call]]:
        """(content not yet given, calls) at the output's end."""
        content, calls = parse_calls(self.text, self.tools)
        held = self.text[self.sent:]
        if not calls:
            return held, []
        before = held.split(_MARKERS[self.tools.parser], 1)[0] if self.tools.parser == "hermes" else ""
        return before if before.strip() else "", calls

"""Structured output's grammars, importable without the engine: a request's constraint
(`response_format`, vLLM's `structured_outputs`) as one grammar text, and that text compiled
against a tokenizer off the caller's thread, within a time limit.

Two libraries, one grammar text. A grammar text is llguidance's serialized form, so what
travels in a `SeqSpec` is plain data that any worker compiles again, and llguidance checks every
one where the request is parsed (`check_syntax`). A JSON schema with a string of bounded length
(`maxLength`, `minLength`) that uses only the keywords in XGRAMMAR_KEYWORDS compiles with
xgrammar instead (`xgrammar_schema`): near the end of such a string llguidance walks the whole
token trie, and xgrammar's masks cost 2.5 to 16 times less there; elsewhere llguidance's cost
less (docs/http.md, "Structured output", has the figures). Every other grammar (regexes,
choices, EBNF, schemas without such a string, or with `pattern`, `format`, numeric bounds,
`oneOf`, ...) compiles with llguidance. Which library a text compiles with depends on the text
alone, so every worker that runs a sequence builds the same matcher. xgrammar's masks allow
some tokens no JSON text may hold (raw control characters inside strings, the tokenizer's
special tokens), so a row of its masks is ANDed with `XTemplate.allowed`; llguidance's masks
are used as they are. The fronts (HTTP, stdin) check a grammar's compile time with llguidance
alone (`Compiler(xgrammar=False)`).

JSON schemas are compiled compact (no free whitespace: a small model under a grammar that
allows whitespace anywhere can spend its tokens on it) with OpenAI's separators; `strict`
refuses schema keywords llguidance does not enforce, where non-strict ignores them.

Compiling builds the grammar's lexer over the tokenizer's vocabulary: milliseconds for
ordinary schemas, more for huge ones. `Compiler.matcher` builds on a small thread pool and
caches a template matcher per (grammar, EOS ids), copied for each sequence; past its
deadline the caller gets `GrammarError` and the build is dropped when it ends.

The copies of one template share its lexer, behind one lock: a step whose rows all copy one
template fills their masks nearly one at a time, whatever the threads. So a grammar has a
family of templates, up to the threads that fill masks (`mask_threads`): as many as compile
with the first within FAMILY_BUILD_S, the rest one by one on the pool as copies are asked
for; each new sequence copies the next (`Copy.family`), and the engine hands a step's rows
to the threads family by family (engine/grammar.py). The figures: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NamedTuple

from qmigrate.hub import xgrammar_json
from qmigrate.hub.xgrammar_json import XTemplate, XTokenizer

log = logging.getLogger(__name__)

MAX_GRAMMAR_CHARS = 1 << 16     # a grammar text travels in one SeqSpec string field
MAX_CHOICES = 1024              # strings of a `choice`
CACHED_TEMPLATES = 64           # compiled grammars a process keeps
FORMATS = ("json", "regex", "choice", "grammar")   # vLLM's structured_outputs keys we take
FAMILY_BUILD_S = 0.02           # compile time a grammar's first build may add for its family

# which schema xgrammar compiles for a grammar text (hub/xgrammar_json.py), each text parsed once while cached
xgrammar_schema = functools.lru_cache(maxsize=CACHED_TEMPLATES)(xgrammar_json.xgrammar_schema)


def mask_threads() -> int:
    """Threads that fill a step's masks: llguidance's executor default, 80% of the cores this
    process may use, at most 32."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(32, cores * 80 // 100))


class Copy(NamedTuple):
    """A sequence's matcher at its grammar's start, and which of the grammar's templates it
    was copied from: copies of one template share a lock (the module's docstring); the
    grammar's text (what a process of the matchers' own compiles: hub/mask_process.py); and, for an
    xgrammar matcher, the tokens its masks may allow at all (`XTemplate.allowed`)."""
    matcher: object
    family: int
    grammar: str = ""
    allowed: object = None


class GrammarError(ValueError):
    """A constraint that does not compile (or not in time); its message names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _json_schema_grammar(schema, strict: bool, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"'{param}' is not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"'{param}' must be a JSON schema (an object)", param)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "lenient": not strict}
    if isinstance(schema, dict) and isinstance(schema.get("x-guidance"), dict):
        options.update(schema["x-guidance"])
    body = dict(schema, **{"x-guidance": options}) if isinstance(schema, dict) else schema
    return json.dumps({"grammars": [{"json_schema": body}]}, separators=(",", ":"))


def from_response_format(value) -> tuple[str, str]:
    """OpenAI's `response_format` as (grammar text, the field it came from); "" for plain text."""
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise GrammarError("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                           param)
    kind = value["type"]
    if kind == "text":
        return "", param
    if kind == "json_object":
        return _json_schema_grammar({"type": "object"}, False, param), param
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise GrammarError("'response_format.json_schema' must be {\"name\", \"schema\", \"strict\"}",
                               "response_format.json_schema")
        strict = spec.get("strict") or False
        if not isinstance(strict, bool):
            raise GrammarError("'response_format.json_schema.strict' must be a boolean",
                               "response_format.json_schema.strict")
        schema = spec.get("schema", spec.get("json_schema"))
        where = "response_format.json_schema.schema"
        return _json_schema_grammar(schema, strict, where), where
    raise GrammarError(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                       "response_format.type")


def from_structured_outputs(value) -> tuple[str, str]:
    """vLLM's `structured_outputs`: exactly one of `json` (a schema), `regex`, `choice` (a list of
    strings), `grammar` (EBNF: GBNF or Lark, as llguidance reads it), as (grammar text, the field);
    "" for none."""
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise GrammarError("'structured_outputs' must be an object with one of json, regex, choice, grammar", param)
    given = {k: v for k, v in value.items() if v is not None and k in FORMATS}
    unknown = sorted(k for k, v in value.items() if v is not None and k not in FORMATS
                     and k not in ("disable_any_whitespace", "whitespace_pattern"))
    if unknown:
        raise GrammarError(f"'structured_outputs.{unknown[0]}' is not supported (one of {', '.join(FORMATS)})",
                           f"structured_outputs.{unknown[0]}")
    if len(given) > 1:
        raise GrammarError("'structured_outputs' takes one of json, regex, choice, grammar", param)
    if not given:
        return "", param
    (kind, text), = given.items()
    where = f"structured_outputs.{kind}"
    if kind == "json":
        return _json_schema_grammar(text, False, where), where
    if kind == "choice":
        if not isinstance(text, list) or not text or len(text) > MAX_CHOICES \
                or not all(isinstance(c, str) and c for c in text):
            raise GrammarError(f"'{where}' must be a list of 1 to {MAX_CHOICES} non-empty strings", where)
        return _from("choice", json.dumps(text), where), where
    if not isinstance(text, str) or not text:
        raise GrammarError(f"'{where}' must be a non-empty string", where)
    return _from("regex" if kind == "regex" else "grammar", text, where), where


def _from(fmt: str, text: str, param: str) -> str:
    import llguidance
    try:
        return llguidance.grammar_from(fmt, text)
    except Exception as exc:  # noqa: BLE001 -- the library's message, for the client
        raise GrammarError(f"'{param}' does not compile: {exc}", param) from None


def check_size(grammar: str, param: str) -> None:
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"'{param}' is too large: {len(grammar)} characters compiled, at most "
                           f"{MAX_GRAMMAR_CHARS}", param)


def check_syntax(grammar: str, param: str) -> None:
    """The grammar's own errors (a bad regex, an unsupported schema keyword under `strict`),
    found without the tokenizer: quick (a few ms for a large schema, once per grammar), so done
    where the request is parsed."""
    error = _syntax_error(grammar)
    if error:
        raise GrammarError(f"'{param}' does not compile: {error}", param)


@functools.lru_cache(maxsize=CACHED_TEMPLATES)
def _syntax_error(grammar: str) -> str:
    import llguidance
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "invalid grammar") if is_error else ""


class Compiler:
    """Grammars compiled against one tokenizer, off the caller's thread, cached by key."""

    def __init__(self, load_tokenizer, vocab_size: int, timeout_s: float, threads: int = 2,
                 xgrammar: bool = True) -> None:
        """`load_tokenizer()`: a transformers tokenizer of the model, called once on the pool
        (a fast tokenizer is not shared between threads); `vocab_size`: the model's logits;
        `xgrammar` False: every grammar with llguidance (where a request is parsed: only to
        refuse one that does not compile in time, without importing xgrammar and torch into
        the HTTP processes; the workers compile with both, each compile within the limit)."""
        self.load_tokenizer, self.vocab_size, self.timeout_s = load_tokenizer, vocab_size, timeout_s
        self.xgrammar = xgrammar
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self.lock = threading.Lock()
        self.tokenizers: dict[tuple[int, ...], Future] = {}
        self.templates: OrderedDict[tuple, Future] = OrderedDict()
        self.started: dict[tuple, float] = {}   # when each compile still running began
        self.families: dict[tuple, list] = {}   # key -> its templates: the first, then those grown
        self.turns: dict[tuple, int] = {}       # key -> copies handed out
        self.growing: set[tuple] = set()        # keys with a template compiling for their family
        self.family_size = mask_threads()
        self.xtokenizers: dict[tuple[int, ...], Future] = {}

    @classmethod
    def for_model(cls, path, trust_remote_code: bool, vocab_size: int, timeout_s: float,
                  prepare: bool = False) -> "Compiler":
        """A model's compiler: its tokenizer loaded on first use or, with `prepare` (a step must
        not wait for it), on a pool thread now, for both libraries."""
        from qmigrate.hub.tokenizer_info import load_tokenizer_info
        compiler = cls(lambda: load_tokenizer_info(path, trust_remote_code)[0], vocab_size, timeout_s)
        if prepare:
            def both():
                eos_ids = load_tokenizer_info(path, trust_remote_code)[2]
                compiler.tokenizer(eos_ids)
                compiler.xtokenizer(eos_ids)
            compiler.pool.submit(both)
        return compiler

    def _tokenizer(self, eos_ids: tuple[int, ...]):
        import llguidance.hf
        hf_tokenizer = self.load_tokenizer()
        size = max(self.vocab_size, len(hf_tokenizer))
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=size, eos_token=list(eos_ids) or None)

    def _xtokenizer(self, eos_ids: tuple[int, ...]) -> XTokenizer:
        hf_tokenizer = self.load_tokenizer()
        return XTokenizer.of(hf_tokenizer, max(self.vocab_size, len(hf_tokenizer)), eos_ids)

    def _xgrammar_schema(self, grammar: str) -> str | None:
        return xgrammar_schema(grammar) if self.xgrammar else None

    def _build(self, grammar: str, eos_ids: tuple[int, ...]):
        schema = self._xgrammar_schema(grammar)
        if schema is not None:
            try:
                return self.xtokenizer(eos_ids).result().template(schema, eos_ids)
            except Exception as exc:  # noqa: BLE001 -- llguidance then (the same everywhere: the same text)
                log.info("xgrammar does not compile a schema (%s); llguidance does it", exc)
        import llguidance
        matcher = llguidance.LLMatcher(self.tokenizer(eos_ids).result(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def _build_family(self, key: tuple, grammar: str):
        """The first template of `grammar` (which the time limit waits for), then as many of
        its family as compile within FAMILY_BUILD_S more (a schema's next compiles take well
        under a millisecond: a burst of its requests finds the family whole); the rest grow
        one by one as copies are asked for (`_copy`). An xgrammar template has no family."""
        first = self._build(grammar, key[1])
        if isinstance(first, XTemplate):
            return first
        family, began = [first], time.monotonic()
        while len(family) < self.family_size and time.monotonic() - began < FAMILY_BUILD_S:
            family.append(self._build(grammar, key[1]))
        with self.lock:
            if key in self.templates:
                self.families[key] = family
        return first

    def tokenizer(self, eos_ids) -> Future:
        """llguidance's tokenizer (built once, in about half a second: the time limit counts
        from when it is there, so that the first grammar a process sees is not refused for it)."""
        return self._once(self.tokenizers, self._tokenizer, eos_ids)

    def xtokenizer(self, eos_ids) -> Future:
        """xgrammar's tokenizer and compiler (the library imported and the vocabulary read
        once, in about 1.5 s: like `tokenizer`, before the time limit counts)."""
        return self._once(self.xtokenizers, self._xtokenizer, eos_ids)

    def _once(self, built: dict, build, eos_ids) -> Future:
        eos = tuple(sorted(eos_ids))
        with self.lock:
            future = built.get(eos)
            if future is None:
                future = built[eos] = self.pool.submit(build, eos)
        return future

    def _tokenizers(self, grammar: str, eos_ids) -> list[Future]:
        """What compiling `grammar` needs first, and the time limit does not count."""
        tok = [self.tokenizer(eos_ids)]
        return tok + [self.xtokenizer(eos_ids)] if self._xgrammar_schema(grammar) is not None else tok

    def start(self, grammar: str, eos_ids) -> Future:
        """The template matcher of `grammar` (a future: compiling may still run)."""
        eos = tuple(sorted(eos_ids))
        self._tokenizers(grammar, eos)
        with self.lock:
            key = (grammar, eos)
            future = self.templates.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self.templates[key] = self.pool.submit(self._build_family, key, grammar)
            self.templates.move_to_end(key)
            while len(self.templates) > CACHED_TEMPLATES:
                gone, _ = self.templates.popitem(last=False)
                self.families.pop(gone, None)
                self.turns.pop(gone, None)
        return future

    def mask_words(self, eos_ids) -> int:
        """int32 words of one row's token mask (32 tokens each)."""
        with self.lock:
            tok = self.tokenizers.get(tuple(sorted(eos_ids)))
        return -(-tok.result().vocab_size // 32)

    def ready(self, grammar: str, eos_ids) -> Copy | None:
        """A fresh matcher if `grammar` is compiled, None while it compiles (never waits);
        GrammarError when it failed or has run past the time limit."""
        key = (grammar, tuple(sorted(eos_ids)))
        if not all(f.done() for f in self._tokenizers(grammar, eos_ids)):
            return None
        future = self.start(grammar, eos_ids)
        if not future.done():
            began = self.started.setdefault(key, time.monotonic())
            if time.monotonic() - began > self.timeout_s:
                raise GrammarError(f"the grammar did not compile within {self.timeout_s:g} s "
                                   "(structured_output_compile_timeout_s)")
            return None
        self.started.pop(key, None)
        return self._copy(key, future.result(), grammar)

    def matcher(self, grammar: str, eos_ids, timeout_s: float | None = None, param: str | None = None) -> Copy:
        """A fresh matcher at the grammar's start; GrammarError when it does not compile in time."""
        for tokenizer in self._tokenizers(grammar, eos_ids):
            tokenizer.result()
        future = self.start(grammar, eos_ids)
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            template = future.result(timeout=limit)
        except FutureTimeout:
            raise GrammarError(f"the grammar did not compile within {limit:g} s "
                               "(structured_output_compile_timeout_s)", param) from None
        except GrammarError as exc:
            raise GrammarError(str(exc), param) from None
        return self._copy((grammar, tuple(sorted(eos_ids))), template, grammar)

    def _copy(self, key: tuple, first, grammar: str) -> Copy:
        """A copy of the next template of `key`'s family, in turn among those built, and one
        more template asked of the pool while the family is short."""
        if isinstance(first, XTemplate):
            return Copy(first.matcher(), 0, grammar, first.allowed)
        with self.lock:
            family = self.families.setdefault(key, [first])
            turn = self.turns[key] = self.turns.get(key, -1) + 1
            index = turn % len(family)
            template = family[index]
            if len(family) < self.family_size and key not in self.growing and key in self.templates:
                self.growing.add(key)
                self.pool.submit(self._grow, key, grammar)
        return Copy(template.deep_copy(), index, grammar)

    def _grow(self, key: tuple, grammar: str) -> None:
        try:
            template = self._build(grammar, key[1])
        except Exception:  # noqa: BLE001 -- the family stays as it is; its copies are as correct
            template = None
        with self.lock:
            self.growing.discard(key)
            family = self.families.get(key)
            if template is not None and family is not None and len(family) < self.family_size:
                family.append(template)

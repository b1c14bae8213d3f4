"""JSON schemas on xgrammar: which grammar texts compile with it (`xgrammar_schema`: a JSON
schema with a length-bounded string whose keywords it all enforces; hub/grammars.py says why),
its view of a tokenizer (`XTokenizer`) and its compiled schemas (`XTemplate`), each sequence's
matcher a new one. Its masks are ANDed with `XTokenizer.allowed`: as they come from the library
they may allow raw control characters inside a length-bounded string and the tokenizer's
special tokens, neither of which a JSON text holds.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import numpy as np


XGRAMMAR_KEYWORDS = frozenset({   # what xgrammar enforces as JSON Schema means it
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minLength", "maxLength"})
ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "examples", "default"})
XGRAMMAR_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _xgrammar_enforces(schema, bounds: list) -> bool:
    """Whether xgrammar enforces every keyword of `schema` (and of each schema inside it);
    each string length bound met is appended to `bounds`."""
    if not isinstance(schema, dict):
        return False
    inner = lambda s: _xgrammar_enforces(s, bounds)
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key not in XGRAMMAR_KEYWORDS:
            return False
        if key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict) or not all(map(inner, value.values())):
                return False
        elif key == "items" and not inner(value):
            return False
        elif key == "anyOf" and not (isinstance(value, list) and value and all(map(inner, value))):
            return False
        elif key == "additionalProperties" and not isinstance(value, bool):
            return False
        elif key == "required" and not (isinstance(value, list) and set(value) <= set(schema.get("properties", {}))):
            return False   # a required property the schema does not describe: llguidance's
        elif key == "$ref" and not (isinstance(value, str) and value.startswith(("#/$defs/", "#/definitions/"))):
            return False
        elif key in ("minLength", "maxLength"):
            bounds.append(value)
    return True


def xgrammar_schema(grammar: str) -> str | None:
    """The JSON schema (as JSON) that xgrammar compiles for a grammar text, or None where
    llguidance compiles it: not a JSON schema, options of the client's own (`x-guidance`), a
    keyword outside XGRAMMAR_KEYWORDS, or no string with a length bound (where llguidance's
    masks cost less: the module's docstring)."""
    if not grammar.startswith('{"grammars":[{"json_schema":'):
        return None
    try:
        (spec,) = json.loads(grammar)["grammars"]
    except (ValueError, KeyError, TypeError):
        return None
    body = spec.get("json_schema") if len(spec) == 1 else None
    if not isinstance(body, dict):
        return None
    options = dict(body.get("x-guidance") or {})
    options.pop("lenient", None)   # strict or not, the keywords it takes are all enforced
    schema = {k: v for k, v in body.items() if k != "x-guidance"}
    bounds: list = []
    if options != XGRAMMAR_OPTIONS or not _xgrammar_enforces(schema, bounds) or not bounds:
        return None
    return json.dumps(schema)


class XTemplate:
    """An xgrammar grammar compiled against a tokenizer: each sequence's matcher is a new one
    (they share nothing that locks); `allowed`, the packed bits of the tokens a JSON text may
    hold at all, with which every mask row of its matchers is ANDed."""

    def __init__(self, compiled, eos_ids, allowed: np.ndarray) -> None:
        self.compiled, self.eos_ids, self.allowed = compiled, list(eos_ids), allowed

    def matcher(self):
        import xgrammar
        return xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=self.eos_ids)


class XTokenizer(NamedTuple):
    """xgrammar's view of a tokenizer (with one set of EOS ids) and its compiler."""
    compiler: object
    allowed: np.ndarray     # packed uint32 words: no special token but EOS, no control character

    @classmethod
    def of(cls, hf_tokenizer, size: int, eos_ids) -> "XTokenizer":
        """A transformers tokenizer's, for `size` logits (the library imported, its vocabulary read)."""
        import xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=size, stop_token_ids=list(eos_ids))
        special = {i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
        special |= set(hf_tokenizer.all_special_ids)
        return cls(xgrammar.GrammarCompiler(info, max_threads=1), _allowed(info.decoded_vocab, special, eos_ids, size))

    def template(self, schema: str, eos_ids) -> XTemplate:
        """A schema compiled compact, with OpenAI's separators (as llguidance's texts are)."""
        compiled = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "),
                                                     strict_mode=False)
        return XTemplate(compiled, eos_ids, self.allowed)


def _allowed(decoded_vocab, special: set[int], eos_ids, size: int) -> np.ndarray:
    ok = np.zeros(-(-size // 32) * 32, dtype=bool)
    for i, text in enumerate(decoded_vocab[:size]):
        ok[i] = bool(text) and min(text) >= 0x20 and i not in special   # JSON holds no raw control character
    ok[[i for i in eos_ids if i < size]] = True
    return np.packbits(ok, bitorder="little").view(np.uint32)

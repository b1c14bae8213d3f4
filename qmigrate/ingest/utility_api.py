"""The API's endpoints beside generation (pure: no sockets, no HTTP server), in vLLM's shapes.

`GET /v1/models/{id}` (`model_card`), `POST /tokenize` (`tokenize`), `POST /detokenize`
(`detokenize`) and `GET /version` (`version`). `tokenize` gives the ids a generation request
with the same prompt or messages would run on, so a client can count a prompt's tokens
before it sends it.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from qmigrate import __version__
from qmigrate.ingest.openai_api import ApiError, not_found
from qmigrate.ingest.chat import encode_chat
from qmigrate.ingest.json_checks import is_int_list
from qmigrate.ingest.prompts import PromptError

TOKENIZE_FIELDS = {"prompt": frozenset(["model", "prompt", "add_special_tokens", "return_token_strs"]),
                   "messages": frozenset(["model", "messages", "add_generation_prompt", "add_special_tokens",
                                          "return_token_strs", "continue_final_message"])}
DETOKENIZE_FIELDS = frozenset(["model", "tokens"])


def model_card(name: str, max_context: int, created: int | None = None) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()) if created is None else created,
            "owned_by": "qmigrate", "max_model_len": max_context}


def find_model(model_id: str, model_names: Collection[str], max_context: int) -> dict:
    if model_id not in model_names:
        raise not_found(model_id, model_names)
    return model_card(model_id, max_context)


def version() -> dict:
    return {"version": __version__}


def _check(body, fields: frozenset, model_names: Collection[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(400, f"'{unknown[0]}' is an unrecognized request argument", unknown[0])
    body = {key: value for key, value in body.items() if value is not None}
    model = body.get("model")
    if model is not None:  # optional, as in vLLM; named, it must be the served model
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string naming the model", "model")
        find_model(model, model_names, 0)
    for name in ("add_special_tokens", "add_generation_prompt", "return_token_strs", "continue_final_message"):
        if not isinstance(body.get(name, False), bool):
            raise ApiError(400, f"'{name}' must be a boolean", name)
    return body


def tokenize(body, *, tokenizer, model_names: Collection[str], max_context: int,
             eos_ids: Collection[int] = ()) -> dict:
    """`{"prompt"}` or `{"messages"}` -> {"count", "max_model_len", "tokens", "token_strs"}."""
    kind = "messages" if isinstance(body, dict) and "messages" in body else "prompt"
    body = _check(body, TOKENIZE_FIELDS[kind], model_names)
    if kind == "prompt":
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ApiError(400, "'prompt' must be a string (or send 'messages')", "prompt")
        if body.get("add_special_tokens", True):
            ids = list(tokenizer.encode(text))
            if len(ids) > 1 and ids[-1] in eos_ids:
                ids.pop()   # as a generation request's prompt is encoded (prompts._encode_prompt)
        else:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        if body.get("continue_final_message", False):
            raise ApiError(400, "'continue_final_message' is not supported by this server (only False)",
                           "continue_final_message")
        if body.get("add_special_tokens", False):
            raise ApiError(400, "'add_special_tokens' with 'messages' is not supported by this server "
                           "(the chat template writes the special tokens)", "add_special_tokens")

        def fail(message: str, param: str | None = None):
            raise PromptError("", message, "messages")
        try:
            ids = encode_chat(body["messages"], tokenizer, fail,
                              add_generation_prompt=body.get("add_generation_prompt", True))
        except PromptError as exc:
            raise ApiError(400, exc.message, "messages") from None
    strs = tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_context, "tokens": ids, "token_strs": strs}


def detokenize(body, *, tokenizer, model_names: Collection[str], vocab_size: int) -> dict:
    """`{"tokens": [ids]}` -> {"prompt": text}."""
    body = _check(body, DETOKENIZE_FIELDS, model_names)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not is_int_list(ids) or (ids and not 0 <= min(ids) <= max(ids) < vocab_size):
        raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(ids)}

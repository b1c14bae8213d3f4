"""Structured output: the intake's forms and refusals, a worker's grammar state across a
migration (recompute and KV transfer), and the official client's requests on a random-weight
model, whose output is valid only because the grammar makes it so."""

from __future__ import annotations

import ctypes
import json
import logging
import re
import time

import numpy as np
import pytest
import torch
jsonschema = pytest.importorskip("jsonschema")   # the test extra; absent where only the GPU tests run

from qmigrate.hub import grammars
from qmigrate.hub.builders import build_tiny_model
from qmigrate.hub.loading import load_model
from qmigrate.hub.tokenizer_info import load_tokenizer_info
from qmigrate.ingest.prompts import PromptError, parse_request
from qmigrate.wire import protocol as P

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb", "ccc"]},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
# the same but for numeric bounds, which xgrammar does not enforce: this one compiles with xgrammar
XSCHEMA = dict(SCHEMA, properties=dict(SCHEMA["properties"], count={"enum": [1, 22, 333]}))
SCHEMAS = {"llguidance": SCHEMA, "xgrammar": XSCHEMA}


def _response_format(library):
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMAS[library], "strict": True}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("structured-model") / "tiny")
    tokenizer, _, eos_ids = load_tokenizer_info(path)
    return path, load_model(path, "cpu")[0], tokenizer, eos_ids


# --- the intake -------------------------------------------------------------------------------

def _parse(tiny, **fields):
    _, _, tokenizer, eos_ids = tiny
    return parse_request({"prompt": "hello", **fields}, "r", tokenizer=tokenizer, max_context=256, eos_ids=eos_ids)


def test_every_form_becomes_a_grammar_and_plain_text_none(tiny):
    assert _parse(tiny, response_format={"type": "text"}).grammar == ""
    assert _parse(tiny).grammar == ""
    forms = [{"response_format": {"type": "json_object"}}, {"response_format": RESPONSE_FORMAT},
             {"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": json.dumps(SCHEMA)}},
             {"structured_outputs": {"regex": "[a-c]{2,4}"}}, {"structured_outputs": {"choice": ["yes", "no"]}},
             {"structured_outputs": {"grammar": 'root ::= "x" [0-9]+'}}]
    texts = [_parse(tiny, **form).grammar for form in forms]
    assert all(texts) and len(set(texts)) == len(texts) - 1   # the schema as an object or a string: one grammar


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "string", "format": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
])
def test_a_constraint_that_cannot_run_is_refused_naming_its_field(tiny, fields, param):
    with pytest.raises(PromptError) as err:
        _parse(tiny, **fields)
    assert err.value.param == param, err.value.message


class StuckCompiler(grammars.Compiler):
    """Its grammars compile only once `release` is set (the tokenizer is ready at once)."""

    def __init__(self, *args, **kw) -> None:
        import threading
        super().__init__(*args, **kw)
        self.release = threading.Event()

    def _build(self, grammar, tokenizer_future):
        self.release.wait(60)
        return super()._build(grammar, tokenizer_future)


def test_a_grammar_past_the_time_limit_is_refused_and_a_good_one_compiles(tiny):
    path, _, tokenizer, eos_ids = tiny
    grammar = _parse(tiny, response_format=RESPONSE_FORMAT).grammar
    slow = StuckCompiler(lambda: tokenizer, len(tokenizer), 0.05)
    try:
        with pytest.raises(grammars.GrammarError, match="did not compile within"):
            slow.matcher(grammar, eos_ids)
    finally:
        slow.release.set()
    fine = grammars.Compiler(lambda: tokenizer, len(tokenizer), 60.0)
    assert not fine.matcher(grammar, eos_ids).matcher.is_error()


# --- a worker's grammar state, moved -----------------------------------------------------------

def _fast_ops(engine):
    """The fast runner with its torch ops: what these tests check is the grammar's state and
    its masks, and the kernels (test_paged_attention, test_families) would run interpreted."""
    if engine.runner.name == "fast":
        engine.runner.use_kernels = False
    return engine


def _core(tiny, runner="hf"):
    """`runner` "fast" (eager on the CPU) feeds each step's tokens on the device: a constrained
    step then samples only once the step before is collected."""
    from qmigrate.engine.engine import Engine
    from qmigrate.worker.core import WorkerCore
    _, model, tokenizer, _ = tiny
    core = WorkerCore(_fast_ops(Engine(model, max_model_len=256, max_kv_tokens=4096, runner=runner,
                                       enforce_eager=runner == "fast")))
    core.engine.grammars.compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    return core


@pytest.fixture
def masks_process(tiny):
    """`use(table)`: the table's matchers in a process of their own (hub/mask_process.py). Closing the
    worker's side ends each process by itself (as when a worker exits), checked after the test
    for those still running."""
    path, *_ = tiny
    tables = []

    def use(table, processes=1, shared=False):
        """`shared`: the masks written to memory shared with the processes, and waited for by
        a GPU's stream, or on the CPU by the caller's thread (HostWaits)."""
        table.use_process(path, False, 60.0, processes, rows=8 if shared else 0,
                          waits=HostWaits() if shared and table.device.type == "cpu" else None)
        tables.append(table)
        return table
    yield use
    processes = []
    for table in tables:   # every socket closed first: the processes end side by side
        if table.device_masks is not None:
            table.device_masks.closing.set()
        for process in getattr(table.matchers, "shards", [table.matchers]):
            processes.append((process, process.proc.poll() is None))
            process.conn.close()
    for process, alive in processes:
        assert process.proc.wait(30) == 0 or not alive


class HostWaits:
    """engine/device_wait.py's `Waits` for the CPU: host memory is the device's, and a wait
    spins on the caller's thread until the word reaches its value (or 30 s pass)."""

    def register(self, address, size):
        return address

    def unregister(self, address):
        pass

    def wait(self, address, value, stream=None):
        from qmigrate.engine.device_wait import reached
        word, deadline = ctypes.c_uint32.from_address(address), time.monotonic() + 30
        while not reached(word.value, value):
            assert time.monotonic() < deadline, f"the word stayed at {word.value}, waited for {value}"
            time.sleep(0.0002)


def _device_waits(table) -> bool:
    """Whether a GrammarTable's masks went to memory shared with its processes (the device's
    wait, or HostWaits's)."""
    return table.device_masks is not None and table.device_masks.regions is not None


def _compiled(core, grammar, eos_ids):
    """The core with `grammar` compiled (a worker answers NEED_IDS until it is)."""
    core.engine.grammars.compiler.matcher(grammar, eos_ids)
    return core


def test_a_worker_never_waits_for_a_compile_and_fails_one_past_the_limit(tiny):
    """A sequence whose grammar is still compiling is handed back (NEED_IDS: the router leases
    it again) without a wait; past the time limit it fails, alone."""
    import time
    _, model, tokenizer, eos_ids = tiny
    core = _core(tiny)
    stuck = core.engine.grammars.compiler = StuckCompiler(lambda: tokenizer, model.config.vocab_size, 0.05)
    stuck.tokenizer(eos_ids).result()
    prompt = [1, 17, 99, 5]
    spec = P.SeqSpec(1, P.pack_i32(prompt), len(prompt), 20, eos_ids=eos_ids,
                     grammar=_parse(tiny, structured_outputs={"regex": "[a-z]+"}).grammar)
    try:
        assert _run(core, _lease(1, prompt, spec, 4)) == ([], P.Finish.NEED_IDS)
        time.sleep(0.1)
        assert _run(core, _lease(2, prompt, spec, 4)) == ([], P.Finish.ERROR)
    finally:
        stuck.release.set()


def _lease(lease_id, ids, spec, num_steps):
    return P.Lease(lease_id, lease_id, 30.0, P.pack_i64([1]), P.pack_i32([len(ids)]), P.pack_i32([ids[-1]]),
                   [spec] if spec is not None else [], b"", num_steps)


def _run(core, lease):
    result, _ = core.run(lease)
    return P.unpack_i32(result.tokens).tolist(), P.Finish(P.unpack_u8(result.status)[0])


_UNMOVED: dict[tuple, tuple] = {}   # (runner, library) -> the tokens unconstrained, and (tokens, end) constrained


@pytest.mark.parametrize("library", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("runner", ["hf", "fast"])
@pytest.mark.parametrize("move", [None, "recompute", "transfer"])
def test_a_sequence_moved_mid_output_keeps_its_grammar_state_and_its_tokens(tiny, move, runner, library):
    """Greedy multi-step leases on one worker, or moved after 9 tokens to a fresh worker that
    only has the ids that travel (and, by transfer, the KV): the same tokens, a document that
    validates against its schema, where the same prompt unconstrained gives no JSON at all;
    with a schema of either library's."""
    _, _, tokenizer, eos_ids = tiny
    prompt = [1, 17, 99, 5, 42, 17, 250, 7]
    grammar = _parse(tiny, response_format=_response_format(library)).grammar
    assert (grammars.xgrammar_schema(grammar) is not None) == (library == "xgrammar")
    spec = lambda ids, **kw: P.SeqSpec(1, P.pack_i32(ids), len(prompt), 120, eos_ids=eos_ids, grammar=grammar, **kw)

    core_of = lambda: _compiled(_core(tiny, runner), grammar, eos_ids)
    if (runner, library) not in _UNMOVED:   # the same for every move: run once a runner and library
        plain, _ = _run(_core(tiny, runner), _lease(1, prompt, P.SeqSpec(1, P.pack_i32(prompt), len(prompt), 40,
                                                                          eos_ids=eos_ids), 40))
        _UNMOVED[runner, library] = plain, _run(core_of(), _lease(1, prompt, spec(prompt), 120))
    plain, (whole, code) = _UNMOVED[runner, library]
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(plain, skip_special_tokens=True))
    assert code == P.Finish.EOS
    core = core_of()
    first, code = _run(core, _lease(1, prompt, spec(prompt), 9))
    assert code == P.Finish.NONE and first == whole[:9]
    ids = prompt + first
    if move is None:
        rest, code = _run(core, _lease(2, ids, None, 120))
    else:
        other = core_of()
        kw = {}
        if move == "transfer":
            other.receive_transfer(7, 1, core.engine.export_kv(1, len(ids) - 1))
            kw = {"kv_from": "w1", "transfer_id": 7}
        rest, code = _run(other, _lease(2, ids, spec(ids, **kw), 120))
        if move == "transfer":
            assert other.num_kv_imported == 1
    assert first + rest == whole and code == P.Finish.EOS
    document = json.loads(tokenizer.decode(whole, skip_special_tokens=True))
    jsonschema.validate(document, SCHEMAS[library])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("library", ["llguidance", "xgrammar"])
def test_matchers_in_a_process_of_their_own_give_the_same_tokens_after_a_move(tiny, masks_process, library,
                                                                              shared):
    """The fast runner (a constrained step samples once the step before is collected) with its
    matchers in their own process: the tokens of the matchers on the worker's thread, moved
    after 9 tokens to another worker whose matchers are in a process too (unmoved: the
    pipelined test above); `shared`: their masks written to memory shared with the process,
    waited for where the device would."""
    _, _, tokenizer, eos_ids = tiny
    prompt = [1, 17, 99, 5, 42, 17, 250, 7]
    grammar = _parse(tiny, response_format=_response_format(library)).grammar
    spec = lambda ids: P.SeqSpec(1, P.pack_i32(ids), len(prompt), 120, eos_ids=eos_ids, grammar=grammar)
    whole, code = _run(_compiled(_core(tiny, "fast"), grammar, eos_ids), _lease(1, prompt, spec(prompt), 120))
    assert code == P.Finish.EOS

    def core_of():
        core = _core(tiny, "fast")
        masks_process(core.engine.grammars, shared=shared)
        return _compiled(core, grammar, eos_ids)
    core = core_of()
    first, code = _run(core, _lease(1, prompt, spec(prompt), 9))
    assert code == P.Finish.NONE and first == whole[:9]
    ids = prompt + first
    other = core_of()
    rest, code = _run(other, _lease(2, ids, spec(ids), 120))
    assert first + rest == whole and code == P.Finish.EOS
    assert shared == _device_waits(core.engine.grammars) == _device_waits(other.engine.grammars)
    jsonschema.validate(json.loads(tokenizer.decode(whole, skip_special_tokens=True)), SCHEMAS[library])


def test_a_json_schema_compiles_with_xgrammar_only_where_it_enforces_every_keyword(tiny):
    from qmigrate.bench.serve_data import BUILTIN_SCHEMA
    routed = lambda **form: grammars.xgrammar_schema(_parse(tiny, **form).grammar)
    assert json.loads(routed(structured_outputs={"json": BUILTIN_SCHEMA})) == BUILTIN_SCHEMA
    assert json.loads(routed(response_format=_response_format("xgrammar"))) == XSCHEMA
    nested = {"$defs": {"n": {"type": "object", "properties": {"v": {"anyOf": [{"type": "string", "minLength": 2},
                                                                                {"const": 1}]}}}},
              "type": "array", "items": {"$ref": "#/$defs/n"}, "title": "t", "minItems": 1}
    assert json.loads(routed(structured_outputs={"json": nested})) == nested
    refused = [{"type": "object"}, {"type": "array", "items": {"type": "string"}},   # no string with a bound
               {"type": "object", "properties": {"maxLength": {"type": "string"}}},   # a property's name
               SCHEMA,   # minimum, maximum
               {"type": "string", "maxLength": 3, "pattern": "a+"}, {"type": "string", "maxLength": 10, "format": "date"},
               {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}]},
               {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
                "additionalProperties": {"type": "integer"}},
               {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["b"]},
               {"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True},
               {"type": "string", "maxLength": 3, "x-guidance": {"whitespace_flexible": True}}]
    assert [routed(structured_outputs={"json": schema}) for schema in refused] == [None] * len(refused)
    assert routed(response_format={"type": "json_object"}) is None
    for form in ({"structured_outputs": {"regex": "[a-c]+"}}, {"structured_outputs": {"choice": ["a", "b"]}},
                 {"structured_outputs": {"grammar": 'root ::= "x"'}}):
        assert routed(**form) is None


def test_a_front_compiles_with_llguidance_and_a_schema_xgrammar_refuses_falls_back_to_it(tiny, monkeypatch):
    """Where a request is parsed, the compile that proves a grammar compiles in time is
    llguidance's (no xgrammar, nor torch, in the HTTP processes); a schema xgrammar fails to
    compile is llguidance's everywhere, as the same text gives the same choice."""
    _, model, tokenizer, eos_ids = tiny
    grammar = _parse(tiny, response_format=_response_format("xgrammar")).grammar
    make = lambda **kw: grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0, **kw)
    assert make().matcher(grammar, eos_ids).allowed is not None
    assert make(xgrammar=False).matcher(grammar, eos_ids).allowed is None

    class Refusing:
        def compile_json_schema(self, *args, **kwargs):
            raise RuntimeError("not this one")
    build = grammars.Compiler._xtokenizer
    monkeypatch.setattr(grammars.Compiler, "_xtokenizer",
                        lambda self, eos: grammars.XTokenizer(Refusing(), build(self, eos).allowed))
    fresh = make().matcher(grammar, eos_ids)
    assert fresh.allowed is None and hasattr(fresh.matcher, "consume_token")


@pytest.mark.parametrize("library", ["llguidance", "xgrammar"])
def test_rows_past_a_sequences_eos_are_eos_only_quietly_and_a_step_run_again_goes_back(tiny, library, caplog):
    """The rows of steps built before a sequence's EOS was seen take no token and allow only
    EOS, without a warning; a step that runs its EOS again finds the document complete."""
    from qmigrate.hub.masks import Matchers
    _, model, tokenizer, eos_ids = tiny
    schema = {"SCHEMA": SCHEMA, "XSCHEMA": XSCHEMA}["XSCHEMA" if library == "xgrammar" else "SCHEMA"]
    grammar = _parse(tiny, structured_outputs={"json": schema}).grammar
    compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    document = tokenizer.encode('{"name": "ab", "count": 1, "ok": true, "tags": []}', add_special_tokens=False)
    width, eos = -(-model.config.vocab_size // 32), eos_ids[0]
    allows = lambda bits, t: bool(int(bits[0, t >> 5]) >> (t & 31) & 1)
    matchers = Matchers()
    fresh = compiler.matcher(grammar, eos_ids)
    assert (fresh.allowed is not None) == (library == "xgrammar")
    assert matchers.set(1, fresh, eos_ids, document)
    n = len(document)
    caplog.set_level(logging.WARNING, logger="qmigrate.hub.masks")
    matchers.note([1], [n], [eos])                       # the sequence's EOS
    for i in (n + 1, n + 2):                             # steps built before it was seen
        bits = np.zeros((1, width), dtype=np.uint32)
        matchers.fill([1], [i], bits)
        assert np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")).tolist() == sorted(eos_ids)
        matchers.note([1], [i], [eos])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    bits = np.zeros((1, width), dtype=np.uint32)
    matchers.fill([1], [n], bits)                        # the EOS's step again: the matcher goes back
    assert allows(bits, eos) and matchers.entries[1][1] == n
    matchers.fill([1], [n - 2], np.zeros((1, width), dtype=np.uint32))   # further back, then on again:
    matchers.note([1], [n - 2], [document[n - 2]])                        # no longer ended
    bits = np.zeros((1, width), dtype=np.uint32)
    matchers.fill([1], [n - 1], bits)
    assert allows(bits, document[n - 1]) and not allows(bits, eos)


def _walks(tiny, grammar, rng, walks=30, steps=200, allowed_too=False):
    """Random walks through a grammar's masks (`Matchers`): each step samples uniformly among
    what the mask allows (EOS, where allowed, one time in four; a token that closes a string, an
    array or an object, where one is allowed, one time in three); the documents of the walks
    that ended, and every token a mask allowed."""
    from qmigrate.hub.masks import Matchers
    _, model, tokenizer, eos_ids = tiny
    compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    width = -(-model.config.vocab_size // 32)
    matchers, ended, seen = Matchers(), [], set()
    closing = {t for t in range(len(tokenizer)) if tokenizer.decode([t]) and not tokenizer.decode([t]).strip('"]}')}
    for walk in range(walks):
        fresh = compiler.matcher(grammar, eos_ids)
        if allowed_too:   # every token of the tokenizer's (xgrammar's masks also allow the model's padding ids)
            fresh = fresh._replace(allowed=np.packbits(np.arange(width * 32) < len(tokenizer),
                                                       bitorder="little").view(np.uint32))
        assert matchers.set(walk, fresh, eos_ids, [])
        out = []
        for i in range(steps):
            bits = np.zeros((1, width), dtype=np.uint32)
            matchers.fill([walk], [i], bits)
            allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")).tolist()
            seen.update(allowed)
            ends = [t for t in allowed if t in eos_ids]
            closers = [t for t in allowed if t in closing]
            if ends and rng.random() < 0.25:
                token = ends[0]
            else:
                token = int(rng.choice(closers if closers and rng.random() < 1 / 3 else allowed))
            if token in eos_ids:
                ended.append(tokenizer.decode(out, skip_special_tokens=True))
                break
            matchers.note([walk], [i], [token])
            out.append(token)
    return ended, seen


NOTES = {"type": "object", "additionalProperties": False, "required": ["notes"],   # bench serve's, closing
         "properties": {"notes": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 24}}}}


@pytest.mark.parametrize("schema", ["SCHEMA", "XSCHEMA", "NOTES", "object"])
def test_random_walks_through_either_librarys_masks_always_validate(tiny, schema):
    """Whatever a mask allows leads to a document that validates; xgrammar's masks, as they
    come from the library, also allow raw control characters inside a string with a length
    bound (which no JSON text holds: `json.loads` refuses them), so each is ANDed with what a
    JSON text may hold."""
    _, _, tokenizer, eos_ids = tiny
    schema = {"SCHEMA": SCHEMA, "XSCHEMA": XSCHEMA, "NOTES": NOTES, "object": {"type": "object"}}[schema]
    grammar = _parse(tiny, structured_outputs={"json": schema}).grammar
    control = {t for t in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))}
    ended, seen = _walks(tiny, grammar, np.random.default_rng(0))
    assert len(ended) >= 10 and not seen & control
    for text in ended:
        jsonschema.validate(json.loads(text), schema)
    if schema is XSCHEMA or schema is NOTES:   # xgrammar's, with strings of a bounded length
        _, raw = _walks(tiny, grammar, np.random.default_rng(0), walks=30, allowed_too=True)
        assert raw & control   # what the AND is for


def test_a_mask_process_drops_foreign_messages_and_one_that_stops_or_dies_is_an_error(tiny, masks_process):
    """Garbage and another wire's message are dropped and the process goes on; one that stops
    answering, or dies, stops its worker with a clear error instead of a hang."""
    import signal
    from qmigrate.engine.grammar import GrammarTable
    from qmigrate.wire import codec
    _, model, tokenizer, eos_ids = tiny
    grammar = _parse(tiny, structured_outputs={"regex": "[0-9]{5}"}).grammar
    t = GrammarTable(model.config.vocab_size, torch.device("cpu"))
    t.compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    masks_process(t)
    t.matchers.conn.send_bytes(b"\x93not a message")
    t.matchers.conn.send_bytes(codec.encode(P.Cancel(P.pack_i64([1]))))
    assert t.set(1, t.matcher(grammar, eos_ids), eos_ids, [])
    rows, bits = t.masks([5, 1], [0, 0])
    allowed = [k for k in range(model.config.vocab_size) if int(bits[0, k >> 5]) >> (k & 31) & 1]
    assert rows.tolist() == [1] and allowed
    assert all(re.fullmatch("[0-9]{1,5}", tokenizer.decode([k])) for k in allowed)
    proc = t.matchers.proc
    t.matchers.answer_timeout_s = 0.5
    proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match="did not answer within 0.5 s"):
            t.masks([1], [0])
    finally:
        proc.kill()
        proc.wait(10)
    with pytest.raises(RuntimeError, match="mask process has ended"):
        t.masks([1], [0])


def test_a_driver_that_does_not_map_the_shared_regions_leaves_the_masks_to_the_host(tiny, masks_process, caplog):
    """cuMemHostRegister refusing the regions (more page-locked memory than the system allows):
    the worker waits for the masks itself from then on, and they are the same."""
    from qmigrate.engine.device_wait import DeviceWaitError
    from qmigrate.engine.grammar import GrammarTable
    _, model, tokenizer, eos_ids = tiny

    class Refusing(HostWaits):
        def register(self, address, size):
            raise DeviceWaitError("cuMemHostRegister failed (CUresult 2)")

    grammar = _parse(tiny, structured_outputs={"regex": "[0-9]{5}"}).grammar
    t = GrammarTable(model.config.vocab_size, torch.device("cpu"))
    t.compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    masks_process(t, shared=True)
    t.device_masks.waits = Refusing()
    assert t.set(1, t.matcher(grammar, eos_ids), eos_ids, [])
    caplog.set_level(logging.WARNING, logger="qmigrate.engine.device_wait")
    for i in range(2):
        rows, bits = t.masks([5, 1], [0, i])
        allowed = [k for k in range(model.config.vocab_size) if int(bits[0, k >> 5]) >> (k & 31) & 1]
        assert rows.tolist() == [1] and allowed and all(re.fullmatch("[0-9]{1,5}", tokenizer.decode([k]))
                                                        for k in allowed)
        t.note([5, 1], [0, i], [7, allowed[0]])
    assert t.device_masks is None and "does not map the shared regions" in caplog.text


def test_a_word_reaches_its_value_cyclically_and_the_cpu_takes_no_device_waits():
    """The device's comparison (`(int32)(word - value) >= 0`), which a counter past 2**32 keeps;
    a CPU engine's masks are waited for on the host."""
    from qmigrate.engine.device_wait import Waits, reached
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    assert reached(3, 0xFFFFFFF0) and not reached(0xFFFFFFF0, 3)   # wrapped: 3 comes after
    assert Waits.make(torch.device("cpu")) is None


@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_a_device_waiting_for_a_stopped_or_dead_mask_process_is_released_and_the_worker_stops(
        tiny, masks_process, fault):
    """Masks the device waits for: a process that stops answering, or dies, while a step's
    sampling waits for its word does not hang the device; the worker's next call is the error."""
    import signal
    from qmigrate.engine.grammar import GrammarTable
    _, model, tokenizer, eos_ids = tiny
    grammar = _parse(tiny, structured_outputs={"regex": "[0-9]{5}"}).grammar
    t = GrammarTable(model.config.vocab_size, torch.device("cpu"))
    t.compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    masks_process(t, shared=True)
    assert t.set(1, t.matcher(grammar, eos_ids), eos_ids, [])
    rows, bits = t.masks([5, 1], [0, 0])
    allowed = [k for k in range(model.config.vocab_size) if int(bits[0, k >> 5]) >> (k & 31) & 1]
    assert _device_waits(t) and rows.tolist() == [1] and allowed
    assert all(re.fullmatch("[0-9]{1,5}", tokenizer.decode([k])) for k in allowed)
    proc = t.matchers.proc
    t.device_masks.timeout_s = 0.5
    proc.send_signal(signal.SIGSTOP if fault == "stopped" else signal.SIGKILL)
    try:
        began = time.monotonic()
        t.masks([1], [1])   # the word never comes: released by the watch (HostWaits gives up after 30 s)
        assert time.monotonic() - began < 10
        with pytest.raises(RuntimeError, match="did not answer within 0.5 s" if fault == "stopped" else "has ended"):
            t.masks([1], [1])
    finally:
        proc.kill()
        proc.wait(10)


def test_a_step_sampled_after_a_released_wait_never_returns_its_tokens(tiny, masks_process):
    """The watch releases the device's wait for a stopped mask process, so the step waiting for
    its masks samples from what its turn of the region holds (stale masks). Collecting that step
    is the worker's error, before any of its tokens is returned: no token sampled without its
    grammar's mask reaches a client. (On the CPU the test double waits on the caller's thread,
    in the collect of the step before, where a GPU's stream would wait.)"""
    import signal
    from qmigrate.engine.engine import Engine
    from qmigrate.engine.rows import StepRow
    _, model, tokenizer, eos_ids = tiny
    grammar = _parse(tiny, structured_outputs={"regex": "[0-9]{30}"}).grammar
    e = _fast_ops(Engine(model, max_model_len=256, max_kv_tokens=4096, runner="fast", enforce_eager=True))
    e.grammars.compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    masks_process(e.grammars, shared=True)
    assert e.set_grammar(2, e.grammars.matcher(grammar, eos_ids), eos_ids, [])
    prompts = {1: [1, 40, 41, 42], 2: [1, 17, 99, 5]}
    first = e.launch([StepRow(sid, p, 0, 0, 1.0, seed=sid) for sid, p in prompts.items()])
    second = e.launch([StepRow(sid, [], len(p), 1, 1.0, seed=sid) for sid, p in prompts.items()], after=first)
    assert e.collect(first)[1] is not None and _device_waits(e.grammars)   # second's sampling queued: it waited
    third = e.launch([StepRow(sid, [], len(p) + 1, 2, 1.0, seed=sid) for sid, p in prompts.items()], after=second)
    proc = e.grammars.matchers.proc
    e.grammars.device_masks.timeout_s = 0.5
    proc.send_signal(signal.SIGSTOP)
    try:
        began = time.monotonic()
        assert e.collect(second)[1] is not None   # its own masks were there; it asks for third's, which never
        assert time.monotonic() - began >= 0.5     # come: the watch released the wait (here the caller's)
        with pytest.raises(RuntimeError, match="did not answer within 0.5 s"):
            e.collect(third)   # sampled from stale masks
        assert third.result is None
    finally:
        proc.kill()
        proc.wait(10)


# --- the official client -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(http_node):
    return http_node.client


def _chat(client, stream=False, **kw):
    args = dict(model="tiny", messages=[{"role": "user", "content": "Give me a thing."}], **kw)
    if not stream:
        out = client.chat.completions.create(**args)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict_output_validates_streamed_and_not(client, stream):
    for seed in range(3):
        text, reason = _chat(client, stream, response_format=RESPONSE_FORMAT, max_tokens=200, temperature=1.0,
                             seed=seed)
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_choice_and_grammar_hold_on_both_endpoints(client, tiny_chat_model_dir):
    # json_object: any object; '}' favoured (the grammar still decides where it may go) so it ends
    tokenizer = load_tokenizer_info(tiny_chat_model_dir)[0]
    close = [t for t in range(len(tokenizer)) if tokenizer.decode([t]).startswith("}")]
    text, reason = _chat(client, response_format={"type": "json_object"}, max_tokens=200,
                         logit_bias={str(t): 30 for t in close[:50]})
    assert reason == "stop" and isinstance(json.loads(text), dict), text
    for seed in range(3):
        out = client.completions.create(model="tiny", prompt="Code:", max_tokens=40, seed=seed, temperature=1.0,
                                        extra_body={"structured_outputs": {"regex": "[a-c]{2,5}-[0-9]{3}"}})
        assert re.fullmatch("[a-c]{2,5}-[0-9]{3}", out.choices[0].text), out.choices[0].text
        assert out.choices[0].finish_reason == "stop"
        text, reason = _chat(client, stream=bool(seed % 2), max_tokens=20, seed=seed, temperature=1.0,
                             extra_body={"structured_outputs": {"choice": ["left", "right", "up or down"]}})
        assert text in ("left", "right", "up or down") and reason == "stop", text
        text, reason = _chat(client, max_tokens=30, seed=seed, temperature=1.0, extra_body={
            "structured_outputs": {"grammar": 'root ::= "n=" digit digit? " " ("ok" | "no")\ndigit ::= [0-9]'}})
        assert re.fullmatch(r"n=[0-9]{1,2} (ok|no)", text) and reason == "stop", text


def test_max_tokens_cuts_a_document_short_as_length(client):
    text, reason = _chat(client, response_format=RESPONSE_FORMAT, max_tokens=3)
    assert reason == "length" and text.startswith("{")


def test_a_bad_constraint_is_a_400_naming_its_field_and_others_go_on(client):
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, max_tokens=5, extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert err.value.body["param"] == "structured_outputs.regex"
    text, reason = _chat(client, max_tokens=20, extra_body={"structured_outputs": {"choice": ["fine"]}})
    assert text == "fine" and reason == "stop"


def test_eos_is_in_the_mask_only_where_the_grammar_accepts(tiny):
    from qmigrate.engine.grammar import GrammarTable
    _, model, tokenizer, eos_ids = tiny
    table = GrammarTable(model.config.vocab_size, __import__("torch").device("cpu"))
    table.compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    grammar = _parse(tiny, structured_outputs={"regex": "ab(cd)?"}).grammar
    text_ids = tokenizer.encode("abcd", add_special_tokens=False)
    table.set(7, table.matcher(grammar, eos_ids), eos_ids, [])

    def eos_allowed(index: int) -> bool:
        rows, bits = table.masks([7], [index])
        return bool((int(bits[0, eos_ids[0] >> 5]) >> (eos_ids[0] & 31)) & 1)
    seen = []
    for i, t in enumerate(text_ids):
        seen.append((tokenizer.decode(text_ids[:i]), eos_allowed(i)))
        table.note([7], [i], [t])
    seen.append(("abcd", eos_allowed(len(text_ids))))
    assert dict(seen) == {text: text in ("ab", "abcd") for text, _ in seen}
    # a step the router dropped: the matcher goes back to where the row stands
    assert not eos_allowed(0)


def test_a_plain_row_beside_a_constrained_one_samples_as_alone(tiny):
    _, _, tokenizer, eos_ids = tiny
    grammar = _parse(tiny, structured_outputs={"regex": "[0-9]{20}"}).grammar
    plain_prompt, prompt = [1, 40, 41, 42], [1, 17, 99, 5]
    alone, _ = _run(_core(tiny), _lease(1, plain_prompt, P.SeqSpec(1, P.pack_i32(plain_prompt), 4, 12,
                                                                    eos_ids=eos_ids), 12))
    core = _compiled(_core(tiny), grammar, eos_ids)
    specs = [P.SeqSpec(1, P.pack_i32(plain_prompt), 4, 12, eos_ids=eos_ids),
             P.SeqSpec(2, P.pack_i32(prompt), 4, 12, eos_ids=eos_ids, grammar=grammar)]
    lease = P.Lease(1, 1, 30.0, P.pack_i64([1, 2]), P.pack_i32([4, 4]), P.pack_i32([42, 5]), specs, b"", 12)
    result, _ = core.run(lease)
    counts = P.unpack_i32(result.counts).tolist()
    tokens = P.unpack_i32(result.tokens).tolist()
    assert tokens[:counts[0]] == alone
    assert re.fullmatch("[0-9]+", tokenizer.decode(tokens[counts[0]:], skip_special_tokens=True))


@pytest.mark.parametrize("where", ["thread", "process", "processes", "shared", "shared-processes",
                                   pytest.param("shared-gpu", marks=pytest.mark.skipif(
                                       not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_pipelined_constrained_step_samples_as_one_collected_first(tiny, where, masks_process):
    """A step launched before the one it follows is collected leaves its sampling until the
    masks, which need that step's tokens, are filled; the tokens, sampled or not, are those of
    the same rows run one collected step at a time, and the constrained row's text matches.
    "processes": the matchers spread over three processes, which take the constrained rows
    (sequences 2 and 3) in the other order than the step's. "shared": the masks written to
    memory shared with the process(es) and waited for where the device would: the sampling is
    queued as soon as the step before is collected ("shared-gpu": by the GPU's stream, both
    engines on the GPU)."""
    import copy
    shared = where.startswith("shared")
    from qmigrate.engine.engine import Engine
    from qmigrate.engine.rows import StepRow
    _, model, tokenizer, eos_ids = tiny
    grammar = _parse(tiny, structured_outputs={"regex": "[0-9]{30}"}).grammar
    prompts = {1: [1, 40, 41, 42], 2: [1, 17, 99, 5], 3: [1, 7, 7, 300, 12]}
    sampling = {1: (0.0, 0), 2: (1.0, 11), 3: (0.8, 12)}

    if where == "shared-gpu":
        model = copy.deepcopy(model).to("cuda")

    def engine(place=where):   # the fast runner (eager on the CPU) feeds a step's tokens on the device
        e = _fast_ops(Engine(model, max_model_len=256, max_kv_tokens=4096, runner="fast", enforce_eager=True))
        e.grammars.compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
        if place != "thread":
            masks_process(e.grammars, 3 if place.endswith("processes") else 1, shared=place.startswith("shared"))
        for sid in (2, 3):
            assert e.set_grammar(sid, e.grammars.matcher(grammar, eos_ids), eos_ids, [])
        return e

    def row(sid, new_ids, start, index):
        return StepRow(sid, new_ids, start, index, sampling[sid][0], seed=sampling[sid][1])

    steps, alone = 12, engine("thread")   # the reference: one collected step at a time, on the same device
    one_by_one = {sid: [] for sid in prompts}
    for i in range(steps):
        rows = [row(sid, p + one_by_one[sid] if i == 0 else one_by_one[sid][-1:],
                    0 if i == 0 else len(p) + i - 1, i) for sid, p in prompts.items()]
        for sid, t in zip(prompts, alone.step(rows)):
            one_by_one[sid].append(t)

    e = engine()
    traced = []
    e.trace = lambda kind, *fields: traced.append((kind, *fields))
    pending = e.launch([row(sid, p, 0, 0) for sid, p in prompts.items()])
    piped, deferred, beside, early = {sid: [] for sid in prompts}, 0, 0, 0
    for i in range(1, steps + 1):
        nxt = None
        if i < steps:
            nxt = e.launch([row(sid, [], len(p) + i - 1, i) for sid, p in prompts.items()], after=pending)
            deferred += nxt.logits is not None
        for sid, t in zip(prompts, e.collect(pending)):
            piped[sid].append(t)
        # the next step's masks are being filled beside the worker, its sampling not yet queued
        # (shared: queued at once, behind the wait for them)
        beside += nxt is not None and nxt.masking is not None and nxt.logits is not None
        early += shared and nxt is not None and nxt.logits is None
        if nxt is not None and i % 2 and not shared:   # every other step sampled as soon as its masks are filled
            while not e.grammars.done(nxt.masking):
                time.sleep(0.001)
            e.settle(nxt)
            early += nxt.logits is None
        pending = nxt
    assert deferred == steps - 1
    assert (beside, early) == ((0, deferred) if shared else (deferred, steps // 2))
    masks = [fields for kind, *fields in traced if kind == "masks"]
    # marked early: those sampled by settle() above, and any whose masks were filled by the next launch
    assert len(masks) == deferred and early <= sum(f[-1] for f in masks) <= deferred
    assert shared == _device_waits(e.grammars)
    assert (where == "shared-gpu") == (shared and type(e.grammars.device_masks.waits).__name__ == "Waits")
    assert all(f[0] == 2 for f in masks)
    assert all(f[1] > 0 for f in masks[1:])   # the seconds the matchers took (shared: the job before's)
    assert piped == one_by_one
    for sid in (2, 3):
        assert re.fullmatch("[0-9]{12,30}", tokenizer.decode(piped[sid], skip_special_tokens=True))

    # A sequence dropped, and another's matcher set afresh, while a job fills their masks: the
    # step still samples, and the rows left follow their grammar as before.
    e = engine()
    pending = e.launch([row(sid, p, 0, 0) for sid, p in prompts.items()])
    nxt = e.launch([row(sid, [], len(p), 1) for sid, p in prompts.items()], after=pending)
    first = e.collect(pending)
    assert (nxt.masking, nxt.logits) == (None, None) if shared else nxt.masking is not None
    e.release(2)
    assert e.set_grammar(3, e.grammars.matcher(grammar, eos_ids), eos_ids, [first[2]])
    second = e.collect(nxt)
    assert [first[2], second[2]] == one_by_one[3][:2] and second[0] == one_by_one[1][1]

    # Three steps launched before any is collected: the third's launch collects the first, which
    # starts the second's masks (and, shared, queues its sampling), and waits for them. (The same
    # engine, its sequences started afresh.)
    for sid in prompts:
        e.release(sid)
    for sid in (2, 3):
        assert e.set_grammar(sid, e.grammars.matcher(grammar, eos_ids), eos_ids, [])
    launched = [e.launch([row(sid, p, 0, 0) for sid, p in prompts.items()])]
    for i in (1, 2):
        launched.append(e.launch([row(sid, [], len(p) + i - 1, i) for sid, p in prompts.items()],
                                 after=launched[-1]))
    got = [e.collect(step) for step in launched]
    assert [[t[k] for t in got] for k in range(3)] == [one_by_one[sid][:3] for sid in prompts]


def _grown(compiler, grammar, eos_ids, size: int) -> None:
    """Copies asked of `compiler` until `grammar`'s family has `size` templates (each copy asks
    the pool for one more while it is short)."""
    import time
    compiler.family_size = size
    key = (grammar, tuple(sorted(eos_ids)))
    deadline = time.monotonic() + 60
    while len(compiler.families.get(key, ())) < size:
        assert time.monotonic() < deadline, "the family did not grow"
        compiler.matcher(grammar, eos_ids)
        time.sleep(0.01)


def test_a_grammar_in_use_grows_a_family_and_its_copies_take_turns(tiny):
    _, model, tokenizer, eos_ids = tiny
    grammar = _parse(tiny, response_format=RESPONSE_FORMAT).grammar
    compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    _grown(compiler, grammar, eos_ids, 3)
    copies = [compiler.matcher(grammar, eos_ids) for _ in range(6)]
    assert sorted(c.family for c in copies) == [0, 0, 1, 1, 2, 2]
    key = (grammar, tuple(sorted(eos_ids)))
    assert len({id(t) for t in compiler.families[key]}) == 3 and len(compiler.families[key]) == 3


def test_masks_of_many_rows_equal_each_row_alone_without_the_torch_helpers(tiny):
    """Several rows' masks (the library's threads, rows of three template families) are each
    row's own; and filling them never imports `llguidance.torch`, whose import compiles a
    function (seconds of a worker's first constrained step), checked in a fresh interpreter."""
    import subprocess
    import sys
    import torch
    from qmigrate.engine.grammar import GrammarTable
    path, model, tokenizer, eos_ids = tiny
    vocab = model.config.vocab_size
    grammar = _parse(tiny, response_format=RESPONSE_FORMAT).grammar
    texts = ['{"name": "ab', '{"name": "abc", "count": 1', '{', '{"name": "a", "count": 12, "ok": tr']
    table = GrammarTable(vocab, torch.device("cpu"))
    table.compiler = grammars.Compiler(lambda: tokenizer, vocab, 60.0)
    _grown(table.compiler, grammar, eos_ids, 3)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    families = set()
    for s, generated in enumerate(ids):
        fresh = table.matcher(grammar, eos_ids)
        families.add(fresh.family)
        assert table.set(s, fresh, eos_ids, generated)
    assert len(families) == 3
    _, together = table.masks(list(range(len(ids))), [len(g) for g in ids])
    together = together.clone()
    for s, generated in enumerate(ids):
        _, alone = table.masks([s], [len(generated)])
        assert torch.equal(alone[0], together[s])
    assert len({tuple(row.tolist()) for row in together}) == len(ids)   # the states differ
    probe = ("import sys, torch; from qmigrate.engine.grammar import GrammarTable; "
             "from qmigrate.hub import grammars; from qmigrate.hub.tokenizer_info import load_tokenizer_info; "
             f"tok, _, eos = load_tokenizer_info({str(path)!r}); v = {vocab}; "
             "t = GrammarTable(v, torch.device('cpu')); t.compiler = grammars.Compiler(lambda: tok, v, 60.0); "
             "g = grammars.from_structured_outputs({'regex': '[0-9]+'})[0]; "
             "[t.set(s, t.matcher(g, eos), eos, []) for s in (1, 2)]; t.masks([1, 2], [0, 0]); t.masks([1], [0]); "
             "print('llguidance.torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"

"""Shared fixtures: the tiny model built offline, and a runner for real `qmigrate` processes."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# numpy's OpenBLAS on one thread, set before anything imports it: a scenario of the early lane
# that starts a process with a preexec_fn forks from its thread, and OpenBLAS's fork handler
# shuts its thread pool down under a matmul the main thread is running (a Triton-interpreted
# kernel's tl.dot), which then spins forever; one thread has no pool to shut down
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import warm  # noqa: E402

if not torch.cuda.is_available():
    # Triton picks the interpreter when it is first imported, for every kernel of the process
    # (its own library included): decide it here, before any test module imports it, so kernel
    # tests run on the CPU and no kernel is ever defined half interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread for the models this process runs (references, in-process engines): the
# suite's role processes and ranks share the machine's cores with it, and a second thread that
# waits for a core at every barrier doubled the CPU time of the in-process model tests on 2 cores
torch.set_num_threads(1)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    """A run stopped with SIGTERM (a `timeout`, a CI runner) would otherwise end at once,
    leaving the processes its tests started running: as an interrupt, the finally blocks and
    fixtures that stop them still run."""
    signal.signal(signal.SIGTERM, _interrupted)
    warm.MOTHER.spawn()
    config.add_cleanup(warm.MOTHER.stop)
    config.addinivalue_line("markers", "early(scenario=f, beside=file): run f(tmp_path, tiny_model_dir) "
                                       "from the first test of that file on, in a thread (early_run)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from qmigrate.hub.builders import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


# --- multi-process scenarios run beside in-process tests ----------------------------------------


class _Early:
    """The scenarios of the selected tests marked `early`, run one after another in one thread.
    A scenario starts with the first test of the module it is to run beside (`beside`, a test
    file's name: one whose tests leave a core idle, in-process tests on one core or nodes that
    mostly wait, while the lane has nothing else to run), or with its own test when that comes
    first or no module is named.

    A scenario gives each process it starts through subprocess an environment of its own
    (`env=`): one started with the process's own (env None) is exec'd from a vfork child that
    shares memory with the main thread, and once failed with EFAULT ("Bad address") in exec,
    as if the environment had changed under it."""

    def __init__(self, items, tmp_path_factory):
        from concurrent.futures import ThreadPoolExecutor
        self.pending = {}   # scenario -> the file name of the module to run beside
        for item in items:
            for m in item.iter_markers("early"):
                self.pending.setdefault(m.kwargs["scenario"], m.kwargs.get("beside"))
        self.futures = {}
        self.tmp = tmp_path_factory
        self.lane = ThreadPoolExecutor(1, thread_name_prefix="early")

    def start_for(self, request) -> None:
        own = {m.kwargs["scenario"] for m in request.node.iter_markers("early")}
        due = [s for s, beside in self.pending.items() if s in own or beside == request.node.path.name]
        for s in due:
            del self.pending[s]
            self.futures[s] = self.lane.submit(s, self.tmp.mktemp(s.__name__.strip("_")),
                                               request.getfixturevalue("tiny_model_dir"))


@pytest.fixture(scope="session")
def _early_lane(request, tmp_path_factory):
    early = _Early(request.session.items, tmp_path_factory)
    try:
        yield early
    finally:
        early.lane.shutdown(wait=True, cancel_futures=True)   # a scenario stops its own processes


@pytest.fixture(autouse=True)
def _early_start(_early_lane, request):
    if _early_lane.pending:
        _early_lane.start_for(request)


@pytest.fixture
def early_run(_early_lane, request):
    """The Future of this test's `early` scenario: its result() waits for the scenario to end
    and returns what it returned, or raises what it raised, so the test fails on it."""
    return _early_lane.futures[request.node.get_closest_marker("early").kwargs["scenario"]]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]

    def finals(self) -> dict[str, dict]:
        return {r["id"]: r for r in self.records() if r.get("done")}


def run_qmigrate(*args: str, stdin: str = "", timeout: float = 180, env: dict | None = None) -> Run:
    """Run the real CLI in a child process and wait for it (no process is left behind)."""
    proc = warm.popen(list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"qmigrate {' '.join(args)} hung for {timeout} s\nstderr:\n{err[-3000:]}")
    return Run(proc.returncode, out, err)


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a process the test started in a session of its own, and everything it started:
    SIGTERM to its group, SIGKILL after grace_s. Never touches another process."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@contextlib.contextmanager
def node_tmpdir():
    """A TMPDIR for the nodes a test starts, to see what they leave behind: short, so that a
    node's ipc:// sockets fit in it (a node whose socket paths would not fit makes its directory
    in /tmp instead, out of the test's sight, whatever the length of pytest's own temp path)."""
    import shutil
    path = Path(tempfile.mkdtemp(prefix="qm-t-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node_tmp():
    with node_tmpdir() as path:
        yield path


@pytest.fixture
def qmigrate():
    return run_qmigrate


TIE = 1e-4  # logits this close are a numerical tie: fp32 summation order may pick either


_REFERENCE_TOKENS: dict[str, dict[tuple, list[int]]] = {}


@functools.lru_cache(maxsize=4)
def _reference_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def greedy_tokens(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate() for one prompt (each is generated once a session)."""
    return greedy_tokens_many(model_dir, [(prompt_ids, max_new_tokens)])[0]


def greedy_tokens_many(model_dir, rows: list[tuple[list[int], int]], max_batch: int = 32) -> list[list[int]]:
    """greedy_tokens for each (prompt_ids, max_new_tokens), the ones not generated yet in
    left-padded batches: a batch costs about what one prompt does. A row's first n greedy
    tokens do not depend on how many more are generated, so a batch runs to its longest
    row's length and each row is cut to its own. Padding may change the last bits of a
    logit; the checker of greedy_reference allows for exactly that (a numerical tie)."""
    import torch
    generated = _REFERENCE_TOKENS.setdefault(str(model_dir), {})
    keys = [(tuple(ids), n) for ids, n in rows]
    pending = sorted((key for key in dict.fromkeys(keys) if key not in generated), key=lambda key: key[1])
    model = _reference_model(str(model_dir))
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else eos or [])
    for start in range(0, len(pending), max_batch):
        batch = pending[start:start + max_batch]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, (ids, _) in enumerate(batch):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=batch[-1][1],
                                 do_sample=False)
        for row, key in enumerate(batch):
            tokens = out[row, width:width + key[1]].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
            generated[key] = tokens[:end]  # a row that ended early is padded past its eos
    return [generated[key] for key in keys]


def greedy_reference(model_dir):
    """A checker of pipeline output against transformers' own greedy generate().

    Exact equality is the rule. The one allowed difference is a numerical tie: where the
    two sequences first part, the reference model's logits for the token we produced and
    the token generate() produced must lie within TIE of each other (after that point the
    two continuations are different texts, so nothing later is compared)."""
    import torch
    model = _reference_model(str(model_dir))

    def check(prompt_ids: list[int], max_new_tokens: int, got: list[int], label: str = "") -> None:
        expected = greedy_tokens(model_dir, prompt_ids, max_new_tokens)
        if got == expected:
            return
        i = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        assert i < len(got) and i < len(expected), f"{label}: lengths differ ({len(got)} vs {len(expected)})"
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + expected[:i]])).logits[0, -1]
        gap = float(logits[expected[i]] - logits[got[i]])
        assert gap < TIE, f"{label}: token {i} is {got[i]}, generate() gives {expected[i]} (logit gap {gap:.2e})"
    return check


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a chat template (the built-in one has none, like many base models)."""
    import shutil
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("models") / "tiny-chat"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def http_node(tiny_chat_model_dir, tmp_path_factory):
    """One live node with the HTTP API on the tiny chat model (helpers.HttpNode), started at its
    first use and stopped at the end of the session: the HTTP tests and the serving benchmark's
    run against a real node share it rather than each starting their own."""
    from helpers import HttpNode
    node = HttpNode(tmp_path_factory.mktemp("http-node"), tiny_chat_model_dir)
    try:
        node.wait_ready()
        yield node
    finally:
        node.stop()


_PORT_LOCKS = Path(tempfile.gettempdir()) / "qmigrate-test-ports"
_held_ports: dict[int, int] = {}   # port -> the open lock file that reserves it


def _port_range() -> range:
    """Ports below the kernel's ephemeral range: it hands none of them out on its own, so a
    port reserved here stays free until the node the test starts binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), low)


def reserve_ports(n: int) -> list[int]:
    """n TCP ports on 127.0.0.1 reserved for this test process: each is held by an exclusive
    lock file that every test run on this machine takes before using a port (released when
    this process exits), outside the ephemeral range, and free to bind when reserved."""
    _PORT_LOCKS.mkdir(exist_ok=True)
    candidates = list(_port_range())
    random.Random(os.getpid()).shuffle(candidates)
    ports = []
    for port in candidates:
        if len(ports) == n:
            return ports
        if port in _held_ports:
            continue
        fd = os.open(_PORT_LOCKS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        except OSError:
            os.close(fd)
            continue
        _held_ports[port] = fd
        ports.append(port)
    raise RuntimeError(f"could not reserve {n} ports")


@pytest.fixture
def ipc_dir():
    """A short directory for ipc:// sockets (a socket path is at most 107 bytes)."""
    import shutil
    path = Path(tempfile.mkdtemp(prefix="qm-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def check_outputs(jsonl: str, prompts: list[dict], model_dir) -> dict[str, dict]:
    """Every prompt finished exactly once, with generate()'s greedy tokens; the final records."""
    finals = {}
    for line in jsonl.splitlines():
        record = json.loads(line)
        if record["done"]:
            assert record["id"] not in finals, f"{record['id']} finished twice"
            finals[record["id"]] = record
    assert sorted(finals) == sorted(p["id"] for p in prompts)
    greedy_tokens_many(model_dir, [(p["prompt_ids"], p["max_new_tokens"]) for p in prompts])
    check = greedy_reference(model_dir)
    for p in prompts:
        check(p["prompt_ids"], p["max_new_tokens"], finals[p["id"]]["token_ids"], p["id"])
    return finals

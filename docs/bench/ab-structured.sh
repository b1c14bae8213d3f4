#!/bin/bash
# Issue 39's cost bars, this tree against another (OLD_TREE, e.g. `git worktree add /tmp/old REV`), ROUNDS
# rounds, each variant on a fresh `qmigrate serve` of the benchmark model with defaults: plain once to warm
# (not counted) and once measured, the 10% mix once to warm and once measured, the open schema, the builtin
# schema, logprobs with 5 alternatives. VARIANTS adds "thr" (this tree with `--worker-setting
# grammar_masks=thread`) and "mp2" (`grammar_mask_processes=2`).
# Prints one line a variant and round.
# Usage: docs/bench/ab-structured.sh OUT_DIR OLD_TREE [ROUNDS] (about 4 minutes with 2 rounds on one H200);
# MODEL, BENCH_FLAGS (added to every run): a smaller try; REPEAT=K: each measured run K times on its server
# (one client, `--request-rate inf,inf,...`), the ratios of the medians (a run of the default workload lasts
# 1.5-2.5 s on an H200, so one late step moves it by several percent); LIST: the variants to run (default
# "new $VARIANTS old"); TRACE=1: each server traced (`serve --trace`), and each run's steps summarized from
# its own window into OUT_DIR/VARIANT-ROUND-KIND.trace.txt (`python -m qmigrate.ops.trace DIR REPORT`).
set -u
out=$(realpath -m "$1") old=$(realpath "$2") rounds=${3:-2}
root=$(realpath "$(dirname "$0")/../..")
model=$(realpath -m "${MODEL:-$root/.bench/bench-model}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
[ -f $model/config.json ] || python -m qmigrate model bench $model > "$out/model.log" 2>&1 || exit 1
. "$root/docs/bench/serve-lib.sh"   # serve_up, serve_down
url=http://127.0.0.1:${PORT:-8000}
rates=$(seq -s, ${REPEAT:-1} | sed 's/[0-9]\+/inf/g')
b() { timeout ${RUN_TIMEOUT:-120} python -m qmigrate bench serve --base-url $url --json "$out/$1.json" --request-rate ${RATES:-$rates} \
        ${BENCH_FLAGS:-} "${@:2}" > "$out/$1.txt" 2>&1 || tail -3 "$out/$1.txt"; }
mix=(--response-format-json-schema builtin --structured-fraction 0.1)
path=${PYTHONPATH:-}
for r in $(seq 1 $rounds); do
  for v in ${LIST:-new ${VARIANTS:-} old}; do
    tree=$root flags=()
    [ $v = old ] && tree=$old
    [ $v = thr ] && flags=(--worker-setting grammar_masks=thread)
    [ $v = mp2 ] && flags=(--worker-setting grammar_mask_processes=2)
    cd $tree; export PYTHONPATH=$tree${path:+:$path}   # the server and the client of that tree
    [ -n "${TRACE:-}" ] && flags+=(--trace "$out/trace-$v-$r")
    serve_up "$out/serve-$v-$r.log" $model "${flags[@]}" || { echo "$v $r: no server"; continue; }
    RATES=inf b $v-$r-plainwarm   # a fresh server's first runs are often its slowest
    b $v-$r-plain; RATES=inf b $v-$r-mixwarm "${mix[@]}"; b $v-$r-mix "${mix[@]}"
    b $v-$r-open --response-format-json-schema "$root/docs/bench/schema-open.json"
    b $v-$r-schema --response-format-json-schema builtin
    b $v-$r-lp5 --logprobs 5
    serve_down
    if [ -n "${TRACE:-}" ]; then
      for kind in plain mix open schema lp5; do
        PYTHONPATH=$root${path:+:$path} python -m qmigrate.ops.trace "$out/trace-$v-$r" "$out/$v-$r-$kind.json" \
          > "$out/$v-$r-$kind.trace.txt" 2>&1
      done
    fi
  done
done
cd $root
python - "$out" "$rounds" "${LIST:-new ${VARIANTS:-} old}" <<'PY'
import json, statistics, sys
out, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def run(name):
    """A file's runs as one: the median run by output tok/s, with the medians of its TPOTs."""
    try:
        runs = json.load(open(f"{out}/{name}.json"))["runs"]
    except (OSError, ValueError, KeyError):
        return None
    if not runs:
        return None
    med = lambda get: statistics.median(get(r) for r in runs)
    one = dict(sorted(runs, key=lambda r: r["output_tok_per_s"])[len(runs) // 2])
    one["output_tok_per_s"] = med(lambda r: r["output_tok_per_s"])
    one["tpot_ms"] = {"p50": med(lambda r: r["tpot_ms"]["p50"])}
    for part in ("plain", "structured"):
        if all(part in r for r in runs):
            one[part] = {"tpot_ms": {"p50": med(lambda r: r[part]["tpot_ms"]["p50"])}}
    return one
for r in range(1, rounds + 1):
    for v in variants:
        p, m, o, s, lp = (run(f"{v}-{r}-{k}") for k in ("plain", "mix", "open", "schema", "lp5"))
        if not (p and m):
            print(f"round {r} {v}: missing")
            continue
        pt, a, b = p["output_tok_per_s"], p["tpot_ms"]["p50"], m.get("plain", m)["tpot_ms"]["p50"]
        x = lambda run: f"{run['output_tok_per_s'] / pt:.2f}x" if run else "-"
        c = m["structured"]["tpot_ms"]["p50"] if "structured" in m else float("nan")
        print(f"round {r} {v:3s}: plain {pt:7,.0f} tok/s TPOT {a:.2f}; mix plain calls' TPOT {b:.2f} ({b / a:.2f}x), "
              f"structured {c:.2f}, mix {m['output_tok_per_s']:,.0f} tok/s; open {x(o)}; schema {x(s)}; lp5 {x(lp)}")
PY

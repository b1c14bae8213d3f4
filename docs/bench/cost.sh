#!/bin/bash
# Issue 39's cost bars on one GPU, against one `qmigrate serve` of the benchmark model with defaults:
# 256 requests at once (mixed-256's shape), ROUNDS interleaved rounds of
#   plain    no schema, no logprobs (the reference)
#   schema   every call with `bench serve`'s builtin JSON schema        (bar: tok/s >= 0.9x plain)
#   open     every call with docs/bench/schema-open.json (no maxLength)
#   lp5      every call with logprobs and 5 alternatives                 (bar: tok/s >= 0.9x plain)
#   mix      10% of the calls with the builtin schema (bar: the plain calls' TPOT p50 within 5% of plain's)
# and the mask's own cost on the CPU (docs/bench/mask_cost.py); the first round's runs also print the
# busiest processes (docs/bench/cpu_busy.py). Prints the table last
# (docs/bench/cost_table.py); the runs' JSON go to OUT_DIR.
# Usage: docs/bench/cost.sh OUT_DIR [ROUNDS] (about 2.5 minutes with 2 rounds on one H100, the
# benchmark model built); KINDS="open mix" runs only those beside plain, MASK_COST=0 skips mask_cost.py.
set -u
out=$1 rounds=${2:-2}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
q() { python -m qmigrate "$@"; }
here=$(dirname "$0")
model=${MODEL:-.bench/bench-model}   # MODEL, BENCH_FLAGS (added to every run): a smaller try
[ -f $model/config.json ] || q model bench $model > "$out/model.log" 2>&1 || exit 1
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; git rev-parse --short HEAD) \
    > "$out/machine.txt" 2>&1
[ "${MASK_COST:-1}" = 0 ] || python "$here/mask_cost.py" $model 8 60 2>&1 | tee "$out/mask_cost.txt"
. "$here/serve-lib.sh"   # serve_up, serve_down
serve_up "$out/serve.log" $model || exit 1
url=http://127.0.0.1:${PORT:-8000}
run() {   # run NAME [bench serve flags]: the first round's with the busiest processes (cpu_busy.py)
    local name=$1 busy=(); shift
    [ "${name##*-}" = 1 ] && busy=(python "$here/cpu_busy.py" --match qmigrate --)
    "${busy[@]}" python -m qmigrate bench serve --base-url $url --json "$out/$name.json" ${BENCH_FLAGS:-} "$@" > "$out/$name.txt" 2>&1 \
        || { echo "$name failed"; tail -5 "$out/$name.txt"; }
}
for r in $(seq 1 $rounds); do
    run plain-$r
    for kind in ${KINDS:-schema open lp5 mix}; do   # KINDS: some of them only
        case $kind in
            schema) run schema-$r --response-format-json-schema builtin ;;
            open) run open-$r --response-format-json-schema "$here/schema-open.json" ;;
            lp5) run lp5-$r --logprobs 5 ;;
            mix) run mix-$r --response-format-json-schema builtin --structured-fraction 0.1 ;;
        esac
    done
done
serve_down
for name in plain-1 schema-1 open-1 lp5-1 mix-1; do
    [ -f "$out/$name.txt" ] && { echo "== $name"; sed -n '/^busiest/,$p' "$out/$name.txt" | head -9; }
done
python "$here/cost_table.py" "$out"

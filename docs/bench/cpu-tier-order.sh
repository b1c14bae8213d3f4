#!/bin/bash
# The host KV tier's later-turn tail on the CPU (docs/benchmarks.md, the host tier at saturation):
# the tiny model, one CPU worker, its pool capped to a quarter of the sessions' working set, ShareGPT
# sessions sent as token ids with little think time, host tier on (0.25 GiB) / off.
# Usage: docs/bench/cpu-tier-order.sh OUT_DIR (from the repository's root; SESSIONS, THINK, PORT).
# Each run writes OUT_DIR/{on,off}.json, .calls.jsonl (every call's times and cached tokens) and
# .status.json (the router's counters at the end).
set -u
out=$1; mkdir -p "$out"
SESSIONS=${SESSIONS:-48} TURNS=6 THINK=${THINK:-0.3}
export PORT=${PORT:-18431} PYTHONUNBUFFERED=1
M=$out/tiny
[ -f $M/config.json ] || python -m qmigrate model tiny $M > /dev/null
. "$(dirname "$0")/serve-lib.sh"   # serve_up, serve_down
ws=$(python - <<PY
from transformers import AutoTokenizer
from qmigrate.bench.serve_data import sharegpt_sessions, with_turn_ids
tok = AutoTokenizer.from_pretrained("$M")
reqs = sharegpt_sessions($SESSIONS, tok, $TURNS, max_model_len=512, replies="dataset")
print(sum(sum(map(len, r.turn_ids)) + sum(r.turn_output_lens) for r in with_turn_ids(reqs, tok)))
PY
)
cap=$((ws / 4)); echo "working set $ws tokens, pool capped to $cap" | tee "$out/sizes.txt"
for run in "on 0.25" "off 0"; do
    set -- $run
    serve_up "$out/$1.log" $M --cpu-workers 1 --max-model-len 512 --kv-offloading-size $2 \
        --worker-setting max_kv_tokens=$cap || exit 1
    python -m qmigrate bench serve --base-url http://127.0.0.1:$PORT --tokenizer $M --dataset sharegpt-multi-turn \
        --sessions $SESSIONS --turns $TURNS --think-time-s $THINK --max-model-len 512 --sessions-as ids \
        --json "$out/$1.json" --calls-jsonl "$out/$1.calls.jsonl" | tail -2
    python -m qmigrate status "$(grep -o '/[^ ]*/topology.yaml' "$out/$1.log" | head -1)" --json > "$out/$1.status.json"
    serve_down
done

#!/bin/bash
# The host KV tier's figures of docs/benchmarks.md ("The host KV tier"), on one GPU.
# Usage: kv-tier.sh PART[,PART...] OUT_DIR, PART one of:
#   bench   the benchmark model (TinyLlama-1.1B's shape)   } multi-turn sessions, the GPU pool capped to a
#   l8      the Llama-3.1-8B shape, dummy weights          } quarter of their working set: host tier on / off;
#                                                            then the pool uncapped: on / off
#   bench-capped, bench-fits, l8-capped, l8-fits: one half of those
#   pull    two workers sharing the GPU, each capped to a quarter of the working set, both with a host
#           tier: conversations placed away from their worker pull their prefix / recompute it
# Each run writes OUT_DIR/NAME.json (`bench serve --json`) and OUT_DIR/NAME.status.json (the router's
# counters and per-tier figures at the end).
set -u
part=$1 out=$2
mkdir -p "$out" .shapes
export PYTHONUNBUFFERED=1
q() { python -m qmigrate "$@"; }
[ -f .bench/bench-model/config.json ] || q model bench .bench/bench-model
[ -f .shapes/llama-3.1-8b/config.json ] || q model shape llama-3.1-8b .shapes/llama-3.1-8b
M=.bench/bench-model L8=.shapes/llama-3.1-8b
# 128 sessions of 6 turns, 60 words a turn, 128-token answers, 4 s between an answer and the next turn
SESSIONS=128 TURNS=6 WORDS=60 ANSWER=128 THINK=4
TIER_GIB=${TIER_GIB:-32}
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; free -g | head -2; date -u) \
    > "$out/machine.txt" 2>&1

working_set() {   # working_set MODEL_DIR: KV tokens of every session's whole conversation
    python - "$1" <<EOF
import sys
from transformers import AutoTokenizer
from qmigrate.bench.serve_data import multi_turn_dataset, transcript
tok = AutoTokenizer.from_pretrained(sys.argv[1])
reqs = multi_turn_dataset($SESSIONS, $TURNS, $WORDS, $ANSWER)
print(sum(len(tok(transcript(r.turns, []))["input_ids"]) + $TURNS * $ANSWER for r in reqs))
EOF
}
. "$(dirname "$0")/serve-lib.sh"   # serve_up, serve_down
sessions() {   # sessions NAME: the multi-turn run, then the router's figures
    q bench serve --base-url http://127.0.0.1:${PORT:-8000} --dataset multi-turn --sessions $SESSIONS --turns $TURNS \
        --question-len $WORDS --answer-len $ANSWER --think-time-s $THINK --json "$out/$1.json"
    q status "$(grep -o '/[^ ]*/topology.yaml' "$out/$1.log" | head -1)" --json > "$out/$1.status.json"
}
one_gpu() {   # one_gpu TAG MODEL WHICH [serve flags]: WHICH capped, fits or both: host tier on / off
    local tag=$1 model=$2 which=$3; shift 3
    local ws; ws=$(working_set $model) || return 1
    local cap=$((ws / 4)) runs=()
    echo "$tag: working set $ws tokens, pool capped to $cap" | tee -a "$out/sizes.txt"
    [ $which = fits ] || runs+=("capped-on $cap $TIER_GIB" "capped-off $cap 0")
    [ $which = capped ] || runs+=("fits-on 0 $TIER_GIB" "fits-off 0 0")
    for run in "${runs[@]}"; do
        set -- $run "$@"
        local name=$tag-$1 kv=$2 gib=$3; shift 3
        serve_up "$out/$name.log" $model --max-model-len 2048 --kv-offloading-size $gib \
            --worker-setting max_kv_tokens=$kv "$@" || return 1
        sessions $name
        serve_down
    done
}
pull() {
    local ws; ws=$(working_set $M) || return 1
    for mode in always never; do
        sed -e "s/prefix_pull: always/prefix_pull: $mode/" configs/two-workers-kv-pull.yaml > "$out/pull-$mode.yaml"
        serve_up "$out/pull-$mode.log" $M --config "$out/pull-$mode.yaml" --max-model-len 2048 \
            --kv-offloading-size $TIER_GIB --worker-setting max_kv_tokens=$((ws / 4)) || return 1
        sessions pull-$mode
        serve_down
    done
}
for p in ${part//,/ }; do
    case $p in
        bench) one_gpu bench $M both ;;
        bench-capped|bench-fits) one_gpu bench $M ${p#bench-} ;;
        l8) one_gpu l8 $L8 both --load-format dummy ;;
        l8-capped|l8-fits) one_gpu l8 $L8 ${p#l8-} --load-format dummy ;;
        pull) pull ;;
        *) echo "unknown part $p"; exit 2 ;;
    esac
done

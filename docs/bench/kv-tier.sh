#!/bin/bash
# The host KV tier's figures of docs/benchmarks.md ("The host KV tier"), on one GPU.
# Usage: kv-tier.sh PART[,PART...] OUT_DIR, PART one of:
#   bench   the benchmark model (TinyLlama-1.1B's shape)   } ShareGPT sessions (the real-models workload),
#   l8      the Llama-3.1-8B shape, dummy weights          } the GPU pool capped to a quarter of their
#                                                            working set: host tier on / off; then the
#                                                            pool uncapped: on / off
#   bench-capped, bench-fits, l8-capped, l8-fits: one half of those
#   pull    two workers sharing the GPU, each capped to a quarter of the working set, both with a host
#           tier, new turns placed by load alone: conversations placed away from their worker pull
#           their prefix / recompute it (the benchmark model); pull-l8: the same with the Llama shape;
#           PULL_MODES="always never auto" adds the default choice (link against prefill)
# Each run writes OUT_DIR/NAME.json (`bench serve --json`) and OUT_DIR/NAME.status.json (the router's
# counters and per-tier figures at the end). The Llama shape needs SmolLM2's tokenizer: TOKENIZER=DIR
# (default: the smollm2 built-in model's, which needs the network on first use). SESSIONS_AS=ids sends
# each turn as token ids (`bench serve --sessions-as ids`: the turn before, the ids the server returned
# for its answer, the next user turn), so a cache finds the whole conversation whatever the model wrote;
# default auto (chat messages, or plain text for a model without a chat template). CALLS=1 writes every
# call's times and tokens to OUT_DIR/NAME.calls.jsonl (`bench serve --calls-jsonl`).
set -u
part=$1 out=$2
mkdir -p "$out" .shapes
export PYTHONUNBUFFERED=1
q() { python -m qmigrate "$@"; }
[ -f .bench/bench-model/config.json ] || q model bench .bench/bench-model
[ -f .shapes/llama-3.1-8b/config.json ] || q model shape llama-3.1-8b .shapes/llama-3.1-8b ${TOKENIZER:+--tokenizer "$TOKENIZER"}
M=.bench/bench-model L8=.shapes/llama-3.1-8b
# 128 ShareGPT sessions of up to 6 turns, each turn carrying the conversation so far (the replies the server
# gave; SESSION_REPLIES=dataset: the dataset's) and asking for as many tokens as the dataset's reply; 4 s
# between an answer and the next turn (THINK=S); every session inside the context
SESSIONS=${SESSIONS:-128} TURNS=6 THINK=${THINK:-4} SESSION_REPLIES=${SESSION_REPLIES:-model} SESSIONS_AS=${SESSIONS_AS:-auto}
TIER_GIB=${TIER_GIB:-32}
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; free -g | head -2; date -u) \
    > "$out/machine.txt" 2>&1

context() { case $1 in $M) echo 2048 ;; *) echo 4096 ;; esac; }   # --max-model-len of each model
working_set() {   # working_set MODEL_DIR: KV tokens of every session's whole conversation (replies as long as the dataset's)
    python - "$1" "$(context $1)" <<EOF
import sys
from transformers import AutoTokenizer
from qmigrate.bench.serve_data import sharegpt_sessions, transcript, with_turn_ids
tok = AutoTokenizer.from_pretrained(sys.argv[1])
reqs = sharegpt_sessions($SESSIONS, tok, $TURNS, max_model_len=int(sys.argv[2]), replies="dataset")
if "$SESSIONS_AS" == "ids":   # the turns' ids and every answer at its asked length
    print(sum(sum(map(len, r.turn_ids)) + sum(r.turn_output_lens) for r in with_turn_ids(reqs, tok)))
else:
    print(sum(len(tok(transcript(r.turns, r.answers[:-1]))["input_ids"]) + r.turn_output_lens[-1] for r in reqs))
EOF
}
. "$(dirname "$0")/serve-lib.sh"   # serve_up, serve_down
sessions() {   # sessions NAME MODEL: the multi-turn run, then the router's figures
    q bench serve --base-url http://127.0.0.1:${PORT:-8000} --tokenizer $2 --dataset sharegpt-multi-turn \
        --sessions $SESSIONS --turns $TURNS --think-time-s $THINK --max-model-len $(context $2) \
        --session-replies $SESSION_REPLIES --sessions-as $SESSIONS_AS --json "$out/$1.json" \
        ${CALLS:+--calls-jsonl "$out/$1.calls.jsonl"}
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
        serve_up "$out/$name.log" $model --max-model-len $(context $model) --kv-offloading-size $gib \
            --worker-setting max_kv_tokens=$kv "$@" || return 1
        sessions $name $model
        serve_down
    done
}
pull() {   # pull TAG MODEL [serve flags]
    local tag=$1 model=$2; shift 2
    local ws; ws=$(working_set $model) || return 1
    for mode in ${PULL_MODES:-always never}; do
        # prefix_wait_s 0: a new turn goes to the first worker that asks for work, never held for the one
        # holding its conversation, so about half the later turns land away from their KV and either pull
        # it (always) or prefill it again (never); the index still knows every holder
        sed -e "s/prefix_pull: always/prefix_pull: $mode/" -e "s/prefix_aware: true/prefix_aware: true\n  prefix_wait_s: 0/" \
            configs/two-workers-kv-pull.yaml > "$out/$tag-$mode.yaml"
        serve_up "$out/$tag-$mode.log" $model --config "$out/$tag-$mode.yaml" --max-model-len $(context $model) \
            --kv-offloading-size $TIER_GIB --worker-setting max_kv_tokens=$((ws / 4)) "$@" || return 1
        sessions $tag-$mode $model
        serve_down
    done
}
for p in ${part//,/ }; do
    case $p in
        bench) one_gpu bench $M both ;;
        bench-capped|bench-fits) one_gpu bench $M ${p#bench-} ;;
        l8) one_gpu l8 $L8 both --load-format dummy ;;
        l8-capped|l8-fits) one_gpu l8 $L8 ${p#l8-} --load-format dummy ;;
        pull) pull pull $M ;;
        pull-l8) pull pull-l8 $L8 --load-format dummy ;;
        *) echo "unknown part $p"; exit 2 ;;
    esac
done

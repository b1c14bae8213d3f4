#!/bin/bash
# The real-shape figures of docs/benchmarks.md ("Models of real shapes, ShareGPT traffic"), on one
# GPU. Needs `pip install '.[bench]'`. Usage: real-models.sh PART[,PART...] OUT_DIR, PART one of:
#   serve   Llama-3.1-8B shape: decode step; `qmigrate serve` with defaults under 1,000 ShareGPT
#           prompts at once and at 1, 4 and 16 req/s; multi-turn sessions, prefix cache on and off
#   engine  Llama-3.1-8B shape, ShareGPT: in-process engine (1,000 prompts), and in-process beside
#           transformers' continuous batching (the first 128 of them); Qwen3-30B-A3B shape:
#           decode step and in-process ShareGPT
# or a piece of those: decode8b, cache_on, cache_off, engine8b, qwen3.
set -u
part=$1 out=$2
mkdir -p "$out" .shapes
export PYTHONUNBUFFERED=1
q() { python -m qmigrate "$@"; }
for s in llama-3.1-8b qwen3-30b-a3b; do   # config.json and SmolLM2's tokenizer (copied from TOKENIZER)
    [ -f .shapes/$s/config.json ] || q model shape $s .shapes/$s ${TOKENIZER:+--tokenizer "$TOKENIZER"}
done
L8=.shapes/llama-3.1-8b Q3=.shapes/qwen3-30b-a3b
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
 python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
 date -u) > "$out/machine.txt" 2>&1

. "$(dirname "$0")/serve-lib.sh"   # serve_up, serve_down
sg() { q bench serve --base-url http://127.0.0.1:8000 --tokenizer $L8 "$@"; }

decode8b() {
    timeout 170 python -m qmigrate bench decode-step --device cuda -m $L8 --load-format dummy --batches 1,64,256 \
        --context 512 --json "$out/l8-decode.json" 2>&1 | grep -v "^ *warm"
}
cache_on() {
    serve_up "$out/serve-cache-on.log" $L8 --load-format dummy || return 1
    sg --dataset sharegpt --requests 1000 --request-rate inf --json "$out/l8-sharegpt-inf.json"
    sg --dataset sharegpt --requests 30 --request-rate 1 --json "$out/l8-sharegpt-1.json"
    sg --dataset sharegpt --requests 60 --request-rate 4 --json "$out/l8-sharegpt-4.json"
    sg --dataset sharegpt --requests 160 --request-rate 16 --json "$out/l8-sharegpt-16.json"
    sg --dataset sharegpt-multi-turn --sessions 128 --turns 4 --think-time-s 1 --json "$out/l8-multiturn-cache-on.json"
    serve_down
}
cache_off() {
    serve_up "$out/serve-cache-off.log" $L8 --load-format dummy --worker-setting enable_prefix_caching=false || return 1
    sg --dataset sharegpt-multi-turn --sessions 128 --turns 4 --think-time-s 1 --json "$out/l8-multiturn-cache-off.json"
    serve_down
}
engine8b() {
    q bench --device cuda -m $L8 --load-format dummy --dataset sharegpt --requests 1000 --paths in-process \
        --json "$out/l8-inprocess-1000.json"
    q bench --device cuda -m $L8 --load-format dummy --dataset sharegpt --requests 128 \
        --paths in-process,transformers-cb --json "$out/l8-peer-128.json"
}
qwen3() {
    # 256 rows of 512 tokens do not fit the KV pool left beside 61 GB of weights on an 80 GB GPU
    timeout 200 python -m qmigrate bench decode-step --device cuda -m $Q3 --load-format dummy --batches 1,64,192 \
        --context 512 --profile --json "$out/q3-decode.json" 2>&1 | grep -v "^ *warm"
    q bench --device cuda -m $Q3 --load-format dummy --dataset sharegpt --requests 1000 --paths in-process \
        --max-seqs 128 --json "$out/q3-inprocess-1000.json"
}
for p in ${part//,/ }; do
    case $p in
        serve) decode8b; cache_on; cache_off ;;
        engine) engine8b; qwen3 ;;
        decode8b|cache_on|cache_off|engine8b|qwen3) $p ;;
        *) echo "unknown part $p"; exit 2 ;;
    esac
done

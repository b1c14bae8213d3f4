# Sourced by the GPU scripts beside it: start `qmigrate serve` and stop it.
# PORT (default 8000) is the API's port.

serve_up() {   # serve_up LOG MODEL [FLAGS...]: qmigrate serve in the background, waits until ready
    local log=$1; shift
    python -m qmigrate serve "$@" --port ${PORT:-8000} > "$log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 300); do
        kill -0 $SERVER 2>/dev/null || { tail -20 "$log"; return 1; }
        grep -q "^ready:" "$log" && return 0
        sleep 1
    done
    return 1
}
serve_down() { kill $SERVER; wait $SERVER; sleep 2; }

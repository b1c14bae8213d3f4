#!/bin/sh
# Start every qmigrate role of one node in the background.
#   launch/start-node.sh CONFIG NODE
# Logs go to $QMIGRATE_RUN_DIR/qmigrate-NODE.log, the pid to qmigrate-NODE.pid
# (QMIGRATE_RUN_DIR defaults to ./run). The node that runs ingest is started with
# --no-stdin: a background process has no terminal, so prompts come from `qmigrate feed`.
set -eu

if [ "$#" -ne 2 ]; then
    echo "usage: $0 CONFIG NODE" >&2
    exit 2
fi
config=$1
node=$2
python=${PYTHON:-python3}
qmigrate=${QMIGRATE:-qmigrate}
run_dir=${QMIGRATE_RUN_DIR:-run}
pid_file="$run_dir/qmigrate-$node.pid"
log_file="$run_dir/qmigrate-$node.log"

# Prints "ingest" when NODE runs the ingest role; fails with the config error otherwise.
roles=$("$python" -c '
import sys
from qmigrate.config import ConfigError, load_topology
try:
    topo = load_topology(sys.argv[1])
    roles = [role for role, _ in topo.roles_on(sys.argv[2])]
except ConfigError as e:
    sys.exit(f"error: {e}")
print(" ".join(roles))
' "$config" "$node")

mkdir -p "$run_dir"
if [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
    echo "node $node already running (pid $(cat "$pid_file")); stop it with launch/stop-node.sh $node" >&2
    exit 1
fi

case " $roles " in
    *" ingest "*) set -- --no-stdin ;;
    *) set -- ;;
esac

# setsid gives the node its own process group, so stop-node.sh can reach the role
# processes it spawned even if the parent itself has to be killed.
if command -v setsid >/dev/null 2>&1; then
    setsid "$qmigrate" node "$config" --node "$node" "$@" </dev/null >>"$log_file" 2>&1 &
else
    nohup "$qmigrate" node "$config" --node "$node" "$@" </dev/null >>"$log_file" 2>&1 &
fi
echo $! >"$pid_file"
echo "started node $node (roles: $roles) pid $! log $log_file"

#!/bin/sh
# Stop a node started by launch/start-node.sh: SIGTERM, then SIGKILL after a grace period.
#   launch/stop-node.sh NODE [GRACE_SECONDS]
set -eu

if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
    echo "usage: $0 NODE [GRACE_SECONDS]" >&2
    exit 2
fi
node=$1
grace=${2:-10}
run_dir=${QMIGRATE_RUN_DIR:-run}
pid_file="$run_dir/qmigrate-$node.pid"

if [ ! -f "$pid_file" ]; then
    echo "node $node: no pid file $pid_file" >&2
    exit 1
fi
pid=$(cat "$pid_file")
# A stale pid file may name a pid the system has since given to another program.
if ! ps -p "$pid" -o args= 2>/dev/null | grep -q -e qmigrate -e "$(basename "${QMIGRATE:-qmigrate}")"; then
    echo "node $node: pid $pid is not running qmigrate; removing stale $pid_file"
    rm -f "$pid_file"
    exit 0
fi

# start-node.sh makes the node a process group leader when setsid exists: signal the group.
target=$pid
if [ "$(ps -p "$pid" -o pgid= | tr -d ' ')" = "$pid" ]; then
    target=-$pid
fi
kill -TERM "$target"
waited=0
while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$grace" ]; do
    sleep 1
    waited=$((waited + 1))
done
if kill -0 "$pid" 2>/dev/null; then
    echo "node $node: pid $pid still running after ${grace}s, sending SIGKILL" >&2
    kill -KILL "$target" 2>/dev/null || true
fi
rm -f "$pid_file"
echo "stopped node $node (pid $pid)"

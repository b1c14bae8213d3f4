#!/bin/sh
# Stop every node of a topology started by launch/start-all.sh, workers' nodes first.
#   launch/stop-all.sh CONFIG
set -eu

if [ "$#" -ne 1 ]; then
    echo "usage: $0 CONFIG" >&2
    exit 2
fi
config=$1
python=${PYTHON:-python3}
remote_dir=${QMIGRATE_REMOTE_DIR:-$(pwd)}
here=$(cd "$(dirname "$0")" && pwd)

nodes=$("$python" -c '
import sys
from qmigrate.config import ConfigError, load_topology
try:
    topo = load_topology(sys.argv[1])
except ConfigError as e:
    sys.exit(f"error: {e}")
# The router goes last so workers can hand their sequences back while draining.
for node in sorted(topo.nodes, key=lambda n: n.name == topo.router.node):
    print(node.name, node.address)
' "$config")

quote() {
    printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"
}

echo "$nodes" | while read -r name address; do
    case "$address" in
        127.0.0.1 | localhost | ::1)
            "$here/stop-node.sh" "$name" || true ;;
        *)
            ssh -n "$address" "cd $(quote "$remote_dir") && launch/stop-node.sh $(quote "$name")" || true ;;
    esac
done

#!/bin/sh
# Start every node of a topology: the router's node first, then the others, each over ssh.
#   launch/start-all.sh CONFIG
# Each machine must have qmigrate installed and this checkout (with CONFIG) at the same
# path, QMIGRATE_REMOTE_DIR (default: the current directory). Nodes whose address is
# 127.0.0.1 or localhost are started here without ssh.
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
# Workers and monitors connect to the router, so its node starts first.
for node in sorted(topo.nodes, key=lambda n: n.name != topo.router.node):
    print(node.name, node.address)
' "$config")

# Single-quote a word for the remote shell.
quote() {
    printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"
}

echo "$nodes" | while read -r name address; do
    case "$address" in
        127.0.0.1 | localhost | ::1)
            "$here/start-node.sh" "$config" "$name" ;;
        *)
            # -n: ssh must not read the node list this loop is reading from stdin.
            ssh -n "$address" "cd $(quote "$remote_dir") && launch/start-node.sh $(quote "$config") $(quote "$name")" ;;
    esac
done

#!/usr/bin/env bash
# The tests with a wall-clock budget or rank processes, run on a busy machine: LOOPS busy loops (default 7) beside
# them, so that on 2 cores the load average sits near 8 (5 loops gave 5-6). Prints the load average every 30 s to stderr and pytest's
# slowest tests. Usage: bash scripts/busy_tests.sh [pytest args]   (LOOPS=N to change the load)
set -uo pipefail
cd "$(dirname "$0")/.."
loops=()
for _ in $(seq 1 "${LOOPS:-7}"); do (while :; do :; done) & loops+=($!); done
(while :; do echo "$(date +%T) load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2; sleep 30; done) & loops+=($!)
trap 'kill "${loops[@]}" 2>/dev/null' EXIT
OMP_NUM_THREADS=1 python3 -m pytest -q -p no:cacheprovider --durations=25 \
    tests/test_launch.py tests/test_write_parallel.py tests/test_write_safety.py tests/test_loader.py \
    tests/test_nodes_harness.py tests/test_s3_server.py tests/test_remote.py tests/test_node_local.py \
    tests/test_node_trust.py tests/test_bucket_output.py tests/test_demo.py tests/test_write_faults.py "$@"

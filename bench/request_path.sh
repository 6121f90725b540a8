#!/usr/bin/env bash
# The request path's figures in one sitting (docs/benchmarks.md, section 2):
# the engine on a no-op device, the overload wait bound, and the front end with one
# process, --workers 2 and granian, beside the landed code (LANDED_SRC, optional).
# ~4 min on 2 cores. Run under the benchmark lock on a shared machine:
#
#   flock /tmp/ember-bench.lock bench/request_path.sh [LANDED_SRC]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
landed=()
[ -n "${1:-}" ] && landed=(--landed-src "$1" --landed-args "--workers 2")
granian=()  # granian is not a dependency: measured beside uvicorn when installed by hand
"$PY" -c "import granian" 2>/dev/null && granian=(--granian)
if [ -n "${1:-}" ]; then
  timeout 300 "$PY" bench/engine.py --landed-src "$1" --reps 6 --out docs/bench/engine.json
else
  timeout 120 "$PY" bench/engine.py --out docs/bench/engine.json
fi
timeout 200 "$PY" bench/scheduler.py --costs gpu --scenarios open_mixed_120 --reps 3 \
  --out docs/bench/overload.json
timeout 400 "$PY" bench/frontend.py --levels 32,128 --texts-per-request 1 --reps 3 \
  --closed-s 2 --variant w2="--workers 2" ${granian[@]+"${granian[@]}"} ${landed[@]+"${landed[@]}"} \
  --out docs/bench/request_path.json

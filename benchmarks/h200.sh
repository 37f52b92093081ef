#!/usr/bin/env bash
# One call on the lent H200 (see reports/BENCHMARKS.md): `lab engine bench` for dummy:llama3-8b
# (bf16 KV, then fp8 KV), the GPU tests, and dummy:smollm2-135m. Each stage has its own time
# limit and writes under $OUT, so one failing stage still leaves the others' figures.
#   usage (device command): bash benchmarks/h200.sh COMMIT [STAGE ...]
#   stages: bf16 fp8 tests kernels smollm2 (default: all five); bf16-noref is bf16 without transformers;
#   decode is bf16's batch-1 and batch-32 decode alone (a quick A/B); pdl is that decode without and with
#   programmatic dependent launch (--pdl), alternated twice, and its GPU test; attn is the fp8 decode attention
#   variants (benchmarks/attention_fp8.py; a kernel staged in .cache/stage/old_attn joins them);
#   attn-prefill is benchmarks/attention_prefill.py (PyTorch's attention kernels on long-prefill shapes) and
#   the GPU attention tests; attn-shapes is benchmarks/attention_shapes.py (a chunk's attention at a shape seen
#   for the first time and again, cuDNN and flash); first-long is benchmarks/first_long_prompt.py (where a
#   fresh engine's first long prompts spend their time, cProfile), twice; attn-plans is benchmarks/attention_plans.py (every cuDNN plan for the long-prefill attention
#   shapes, through the cuDNN frontend carried as a wheel in .whl-fe); new-shapes is benchmarks/new_shape_ttft.py (time to first
#   token of chats, chat turns and long prompts at new lengths, then again, per --prefill-attention); prefill-long is cold prefill at 8K, 32K and 131K alone;
#   long and 1m run ladders/h200-long.yaml and ladders/h200-1m.yaml a call at a time (resumed from the
#   store carried in .cache/long/); long-cal calibrates ladders/h200-long.yaml into that store (3 boots);
#   prefill-ref-long is cold prefill at 32K, 64K and 131K beside transformers (sdpa, logits of the last position), a lone
#   prompt's steps LONE tokens (32768; 8192 is the plain budget); prefill-1m is one cold
#   prefill of 1,048,576 tokens (dummy:llama3-8b-1m, fp8 KV: a call of its own);
#   profile is the per-kernel time of a decode step at 256 requests, fp8 and bf16 KV, and at batch 1 (bf16);
#   prefill-profile is benchmarks/prefill_profile.py (a cold 32K and 131K prefill by part against its floor,
#   bf16 KV at each step budget of PROFILE_MNBT; 131K with fp8 KV on dummy:llama3-8b-1m); prefill-ref is
#   cold prefill at 2K and 8K beside transformers (sdpa, eager) in one call, without the throughput runs;
#   lab is `lab calibrate ladders/h200.yaml --boots 3` (the control's boot-to-boot noise), then
#   `lab run ladders/h200.yaml` end to end (warm-up boot, control, five arms, control), then `lab ls`,
#   `lab report` and `lab compare` of each arm against the control: the store comes back as lab-h200.db, the
#   report and the boots' logs as lab-report.tgz, the GPU's power, temperature and clocks through the run as
#   lab-dmon.txt (a call of its own: the ladder takes most of ten minutes); served is batch-1 and
#   64-stream decode offline and through the server, at three GIL switch intervals, with a py-spy
#   profile (--gil: who holds the GIL) of each served engine when py-spy is in .whl; spec is batch-1 and
#   32-stream decode plain and with prompt lookup, sampled (temperature 1) and greedy; sampler is
#   benchmarks/sampler_batch.py (32 seeded rows drawn together against one at a time); tier-restart is
#   benchmarks/tier_restart.py at 100K tokens (resume TTFT after a restart with and without the file tier, and
#   whether every resume answers the same greedy text); mixed-noise is benchmarks/mixed_noise.py (the scatter
#   of a cold 32K prefill alone, after a chat, and with a chat or a token-id completion sent 0.5 s into it; mixed-noise-gil with a 0.5 ms GIL switch
#   interval, mixed-noise-nofreeze without freezing the start-up heap out of the garbage collector); inject3 is benchmarks/ladders/h200-inject3.yaml (10 arms with
#   a true 3 % slowdown) after a 3-boot calibration, tallied; calibrate is 7 control boots of
#   ladders/h200.yaml into .cache/lab/ (carry [".cache/lab"]), which the lab stage of the next call uses;
#   c64ctx calibrates benchmarks/ladders/h200-c64-context.yaml (C64 at 2K context, 4 boots); known-effect
#   is the GPU test of the injected delay alone; cpu-intel is benchmarks/cpu_read_ceiling.py (copy, read and
#   one-row product bandwidth) and `lab engine bench --device cpu` of SmolLM2 on two of the host's cores (issue 13 item 6); noop-cal and noop-run are benchmarks/ladders/bundled-noop.yaml on
#   two of them (issue 14): an 8-boot calibration, then the ladder in the next call (together they
#   are longer than one call, so each goes beside a GPU stage). A stage written bg:STAGE runs on cores 0 and 1 beside the call's other stages,
#   which are kept off those cores; its files come back in bg.tgz
set -u
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
# Every stage boots the engine or the lab: a wheel missing from .whl fails them all, so say which
# one before spending the call.
missing=$(python3 -c '
import importlib.util
mods = ("fastapi", "uvicorn", "pydantic", "sqlalchemy", "optuna", "gguf", "llguidance", "annotated_doc", "xxhash")
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))')
if [ -n "$missing" ]; then
  echo "h200.sh: not importable here: $missing (add their wheels to .whl)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
commit=${1:-unknown}
shift || true
stages=${*:-bf16 fp8 tests kernels smollm2}
{ echo "commit $commit"; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv;
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'; } > "$OUT/env.txt" 2>&1
big=(--model dummy:llama3-8b --dtype bfloat16 --max-model-len 131072 --max-num-batched-tokens 8192
     --max-num-seqs 256 --prompt-tokens 1024 --decode-tokens 64 --throughput-tokens 1024)
# An xz file decompressed with Python's lzma: the image may lack xz-utils.
unxz_to() { python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; }
# The long-context stages' store and Triton cache in .cache/long: LONG_STORE (an xz store, such as
# one committed under benchmarks/results) seeds the store when there is none, LONG_TRITON (a
# triton.tgz from an earlier call) the cache when it is empty.
seed_long() {
  mkdir -p .cache/long/triton
  [ ! -f "$1" ] && [ -n "${LONG_STORE:-}" ] && unxz_to "$LONG_STORE" "$1"
  [ -n "${LONG_TRITON:-}" ] && [ -z "$(ls -A .cache/long/triton)" ] && tar xzf "$LONG_TRITON" -C .cache/long
  export TRITON_CACHE_DIR=$PWD/.cache/long/triton
}
run_stage() {
  local stage=$1
  case $stage in
    bf16) timeout 330 python3 -m lab.engine bench "${big[@]}" --prefill-lengths 2048,8192,32768,131000 \
            --concurrency 32 --repeats 2 --throughput 64,256 --json "$OUT/llama3_8b_bf16.json" \
            > "$OUT/llama3_8b_bf16.txt" 2>&1 ;;
    bf16-noref) timeout 200 python3 -m lab.engine bench "${big[@]}" --prefill-lengths 2048,8192,32768,131000 \
            --concurrency 32 --repeats 2 --reference none --throughput 64,256 --json "$OUT/llama3_8b_bf16.json" \
            > "$OUT/llama3_8b_bf16.txt" 2>&1 ;;
    prefill-ref) timeout 240 python3 -m lab.engine bench "${big[@]}" --prefill-lengths 2048,8192 --concurrency 32 \
            --repeats 3 --throughput "" --json "$OUT/llama3_8b_prefill_ref.json" > "$OUT/llama3_8b_prefill_ref.txt" 2>&1 ;;
    decode) timeout 120 python3 -m lab.engine bench "${big[@]}" --prefill-lengths "" --concurrency 32 --repeats 3 \
            --reference none --json "$OUT/llama3_8b_decode.json" > "$OUT/llama3_8b_decode.txt" 2>&1 ;;
    pdl) # batch-1 and batch-32 decode without and with programmatic dependent launch, alternated (ABAB),
         # then the GPU test that it changes no token
         { for i in 1 2 3 4; do p=$([ $((i % 2)) = 0 ] && echo true || echo false)
             timeout 100 python3 -m lab.engine bench "${big[@]}" --pdl $p --prefill-lengths "" --concurrency 32 \
               --repeats 3 --reference none --json "$OUT/decode_pdl_$i.json"; done
           timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_gpu.py \
             -k "programmatic or graph"; } > "$OUT/pdl.txt" 2>&1 ;;
    fp8) timeout 120 python3 -m lab.engine bench "${big[@]}" --kv-cache-dtype fp8 --prefill-lengths "" \
            --concurrency 32 --repeats 1 --reference none --throughput 256 --json "$OUT/llama3_8b_fp8.json" \
            > "$OUT/llama3_8b_fp8.txt" 2>&1 ;;
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_gpu.py \
            tests/engine/test_kernels.py tests/engine/test_kernel_gemv.py tests/engine/test_chunk_attention.py \
            tests/engine/test_decode_graphs.py tests/engine/test_cold.py tests/lab/test_known_effect.py \
            > "$OUT/gpu_tests.txt" 2>&1 ;;
    spec) # prompt lookup beside plain decoding on random weights: sampled at temperature 1 its drafts
         # miss (its cost), greedy the random model repeats itself and drafts are accepted
         for mode in plain-t1 lookup-t1 plain-t0 lookup-t0; do
           extra=(--decode-temperature "${mode#*-t}"); [ "${mode%-*}" = lookup ] && extra+=(--prompt-lookup true)
           timeout 120 python3 -m lab.engine bench "${big[@]}" "${extra[@]}" --prefill-lengths "" --decode-tokens 256 \
             --concurrency 32 --repeats 3 --reference none --throughput "" --json "$OUT/spec_$mode.json" \
             > "$OUT/spec_$mode.txt" 2>&1; done ;;
    mixed-noise|mixed-noise-gil|mixed-noise-nofreeze)
         # -gil: the same with a 0.5 ms GIL switch interval (the engine's default is 5 ms);
         # -nofreeze: without freezing the start-up heap out of the garbage collector
         extra=(); [ "$stage" = mixed-noise-gil ] && extra=(--gil-switch-interval-ms 0.5)
         [ "$stage" = mixed-noise-nofreeze ] && extra=(--gc-freeze false)
         timeout 240 python3 benchmarks/mixed_noise.py --model dummy:llama3-8b --device cuda --long-tokens 32000 \
            --rounds 12 --json "$OUT/$stage.json" -- --dtype bfloat16 --max-model-len 40960 \
            --max-num-batched-tokens 8192 --max-num-seqs 256 --cuda-graph-max-batch-size 64 "${extra[@]}" \
            > "$OUT/$stage.txt" 2>&1 ;;
    sampler) timeout 120 python3 benchmarks/sampler_batch.py > "$OUT/sampler_batch.txt" 2>&1 ;;
    tier-restart) timeout 300 python3 benchmarks/tier_restart.py --model dummy:llama3-8b --device cuda \
            --context-tokens 100000 --turn-tokens 10000 --repeats 2 --file-tier-bytes 21474836480 \
            --workdir /tmp/tier-restart --json "$OUT/tier_restart.json" > "$OUT/tier_restart.txt" 2>&1 ;;
    inject3) # issue 14's power on the GPU: 10 arms with a true 3 % slowdown of batch-1 decode
         db=$OUT/inject3.db; run=h200-inject3-$commit
         { timeout 150 python3 -m lab calibrate benchmarks/ladders/h200-inject3.yaml --boots 3 --db "$db" \
             --name "$run-calibration"; echo "lab calibrate exit $?"
           timeout 360 python3 -m lab run benchmarks/ladders/h200-inject3.yaml --db "$db" --name "$run"
           echo "lab run exit $?"
           python3 -m lab ls --db "$db" "$run"; python3 benchmarks/issue14_verdicts.py "$db" "$run"
           COLUMNS=200 python3 -m lab compare --db "$db" W1ctl I01; } > "$OUT/inject3.txt" 2>&1 ;;
    c64ctx) # 64-stream decode's boot-to-boot noise with 2,048 tokens of context per stream
         { timeout 170 python3 -m lab calibrate benchmarks/ladders/h200-c64-context.yaml --boots 4 \
             --db "$OUT/c64ctx.db" --name "h200-c64ctx-$commit"; echo "lab calibrate exit $?"; } > "$OUT/c64ctx.txt" 2>&1 ;;
    known-effect) timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/lab/test_known_effect.py \
            > "$OUT/gpu_known_effect.txt" 2>&1 ;;
    calibrate) # 7 control boots of ladders/h200.yaml into .cache/lab/lab-h200.db (carry [".cache/lab"]):
         # the lab stage of the next call runs the ladder into the same store and is judged with them
         # a fresh store: a warm machine keeps .cache/ from the previous call, whose run names would clash
         mkdir -p .cache/lab; rm -f .cache/lab/lab-h200.db
         # CAL_LIMIT shortens it to share a call; cut short, it still stores the noise of the boots it finished
         { timeout "${CAL_LIMIT:-560}" python3 -m lab calibrate ladders/h200.yaml --boots 7 --db .cache/lab/lab-h200.db \
             --name "h200-$commit-calibration7"; echo "lab calibrate exit $?"; } > "$OUT/calibrate.txt" 2>&1
         cp .cache/lab/lab-h200.db "$OUT/lab-h200-calibration.db" ;;
    cpu-intel) # issue 13 item 6: the CPU path on this host's CPU (an Intel Xeon), two of its cores, as on a
         # 2-core VM: SmolLM2-135M's shape (dummy weights: the real ones are a 93 MB wheel, over what a call carries) offline, served and beside transformers; the product layouts are measured at load
         { lscpu | grep -E "^Model name|^Flags" | cut -c 1-900
           OMP_NUM_THREADS=2 timeout 60 taskset -c 0,1 python3 benchmarks/cpu_read_ceiling.py
           OMP_NUM_THREADS=2 timeout "${CPU_LIMIT:-170}" taskset -c 0,1 python3 -m lab.engine bench --device cpu --model dummy:smollm2-135m --prefill-lengths 512 \
             --repeats 2 --served --json "$OUT/cpu_intel.json"; echo "bench exit $?"; } > "$OUT/cpu_intel.txt" 2>&1 ;;
    noop-cal|noop-run) # usually bg:noop-cal beside calibrate, then bg:noop-run beside lab: the store is
         # carried in .cache/lab/ (carry [".cache/lab"], or a warm machine) from the calibration to the run
         mkdir -p .cache/lab; db=.cache/lab/bnoop.db; run=bnoop-$commit
         { if [ "$stage" = noop-cal ]; then
             rm -f "$db"
             OMP_NUM_THREADS=2 timeout 200 taskset -c 0,1 python3 -m lab calibrate benchmarks/ladders/bundled-noop.yaml \
               --boots 8 --db "$db" --name "$run-calibration"; echo "lab calibrate exit $?"
           else
             OMP_NUM_THREADS=2 timeout 500 taskset -c 0,1 python3 -m lab run benchmarks/ladders/bundled-noop.yaml \
               --db "$db" --name "$run"; echo "lab run exit $?"
             python3 benchmarks/issue14_verdicts.py "$db" "$run"; fi; } > "$OUT/$stage.txt" 2>&1
         cp "$db" "$OUT/bnoop.db" ;;
    kernels) { timeout 90 python3 benchmarks/kernels/bench_gemv.py;
            timeout 90 python3 benchmarks/kernels/bench_kernels.py; } \
            > "$OUT/kernels.txt" 2>&1 ;;
    attn-shapes) timeout 150 python3 benchmarks/attention_shapes.py > "$OUT/attention_shapes.txt" 2>&1 ;;
    first-long) # twice, in two processes: the first finds every on-disk cache (Triton's, the driver's) empty
         for i in 1 2; do timeout 200 python3 benchmarks/first_long_prompt.py ${FIRST_LONG_ARGS:-} \
             > "$OUT/first_long_prompt_$i.txt" 2>&1; done ;;
    attn-plans) # the cuDNN frontend's wheel travels in .whl-fe, carried; fetch it here with
         # python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
         #   --platform manylinux_2_28_x86_64 -d .whl-fe nvidia-cudnn-frontend==1.32.0
         [ -d .whl-fe ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
             --upgrade --target /tmp/site-fe .whl-fe/*.whl
         PYTHONPATH=$PYTHONPATH:/tmp/site-fe timeout 240 python3 benchmarks/attention_plans.py \
             > "$OUT/attention_plans.txt" 2>&1 ;;
    new-shapes) # NEW_SHAPE_MODES: the settings; NEW_SHAPE_ARGS: more arguments (--warm-largest);
         # NEW_SHAPE_TAG: a suffix for the output files, to run the stage twice in one call
         timeout 300 python3 benchmarks/new_shape_ttft.py --modes "${NEW_SHAPE_MODES:-cudnn,flash,auto}" \
            ${NEW_SHAPE_ARGS:-} --json "$OUT/new_shape_ttft${NEW_SHAPE_TAG:-}.json" \
            > "$OUT/new_shape_ttft${NEW_SHAPE_TAG:-}.txt" 2>&1 ;;
    attn-prefill) { timeout 240 python3 benchmarks/attention_prefill.py;
            timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_chunk_attention.py \
              tests/engine/test_kernels.py -k "attention or prefill"; } > "$OUT/attention_prefill.txt" 2>&1 ;;
    prefill-long) timeout 200 python3 -m lab.engine bench "${big[@]}" --prefill-lengths 8192,32768,131000 \
            --concurrency 32 --repeats 1 --reference none --throughput "" --json "$OUT/prefill_long.json" \
            > "$OUT/prefill_long.txt" 2>&1 ;;
    prefill-ref-long) timeout 300 python3 -m lab.engine bench "${big[@]}" --prefill-lengths 32768,65536,131000 \
            --lone-prefill-tokens "${LONE:-32768}" --concurrency 32 --repeats 1 --reference-prefill-max 131072 --throughput "" \
            --json "$OUT/prefill_ref_long.json" > "$OUT/prefill_ref_long.txt" 2>&1 ;;
    prefill-1m) timeout 590 python3 -m lab.engine bench --model dummy:llama3-8b-1m --dtype bfloat16 \
            --kv-cache-dtype fp8 --max-model-len 1052672 --kv-cache-memory-bytes 72000000000 --max-num-batched-tokens 8192 --max-num-seqs 8 \
            --prompt-tokens 128 --decode-tokens 16 --concurrency 2 --prefill-lengths 1048576 --repeats 1 \
            --reference none --throughput "" --json "$OUT/prefill_1m.json" > "$OUT/prefill_1m.txt" 2>&1 ;;
    attn) PYTHONPATH=$PYTHONPATH:$PWD/.cache/stage timeout 150 python3 benchmarks/attention_fp8.py \
            > "$OUT/attention_fp8.txt" 2>&1 ;;
    profile) { timeout 120 python3 benchmarks/step_profile.py --kv-cache-dtype fp8;
            timeout 100 python3 benchmarks/step_profile.py;
            timeout 100 python3 benchmarks/step_profile.py --requests 1 --prompt-tokens 128 --decode-before 64 \
              --steps 64; } > "$OUT/step_profile.txt" 2>&1 ;;
    prefill-profile) # PROFILE_MNBT: the step budgets of the bf16 runs (a lone long prompt in larger chunks),
         # PROFILE_LENGTHS their prompt lengths; PROFILE_FP8=0 leaves out the fp8 131K run
         { for b in ${PROFILE_MNBT:-8192 32768}; do
             timeout 150 python3 benchmarks/prefill_profile.py --lengths "${PROFILE_LENGTHS:-32768,131000}" \
               --max-num-batched-tokens "$b" --json "$OUT/prefill_profile_bf16_$b.json"; done
           if [ "${PROFILE_FP8:-1}" = 1 ]; then
             timeout 150 python3 benchmarks/prefill_profile.py --model dummy:llama3-8b-1m --kv-cache-dtype fp8 \
               --lengths 131000 --json "$OUT/prefill_profile_fp8.json"; fi; } > "$OUT/prefill_profile.txt" 2>&1 ;;
    lab) run=h200-$commit
         # power, temperature and clocks once a second, to set beside each boot's figures
         nvidia-smi dmon -s pc -d 1 -o DT > "$OUT/lab-dmon.txt" 2>&1 &
         dmon=$!
         # a store carried in .cache/lab/ holds the calibration (stage calibrate); else 3 boots here
         if [ -f .cache/lab/lab-h200.db ]; then cp .cache/lab/lab-h200.db "$OUT/lab-h200.db"; fi
         { if [ ! -f .cache/lab/lab-h200.db ]; then
             timeout 170 python3 -m lab calibrate ladders/h200.yaml --boots 3 --db "$OUT/lab-h200.db" --name "$run-calibration"
             echo "lab calibrate exit $?"; fi
           limit=400; [ -f .cache/lab/lab-h200.db ] && limit=540
           timeout $limit python3 -m lab run ladders/h200.yaml --db "$OUT/lab-h200.db" --name "$run"
           echo "lab run exit $?"
           kill $dmon
           python3 -m lab ls --db "$OUT/lab-h200.db" "$run"
           python3 -m lab report --db "$OUT/lab-h200.db" --out reports "$run"
           for arm in A1nooverlap A2cublas A3fp8kv A4mnbt2k A5nographs; do
             COLUMNS=200 python3 -m lab compare --db "$OUT/lab-h200.db" C0ctl "$arm"; done
           tar czf "$OUT/lab-report.tgz" "reports/$run" runs; } > "$OUT/lab.txt" 2>&1 ;;
    long|1m) # ladders/h200-long.yaml or h200-1m.yaml, a boot or so per call: the store is carried in
         # .cache/long/ (run with carry [".cache/long"]) and each call resumes the run it holds.
         # Triton compiles into .cache/long/triton, which comes back as triton.tgz: unpacked into the
         # carried folder, it lets the next call's boots (and a later session's, on a fresh machine)
         # load the kernels instead of compiling them, so they are warm without a warm-up boot.
         # LONG_LIMIT stops lab run sooner (a call that only warms the caches); a killed boot is retried.
         # LONG_RUN names the run to resume when it was started at another commit (another session).
         # The 1M ladder runs its control alone (lab sweep --control-only): its arm's window would not fit
         # a 30-minute session. --time-budget keeps a call from starting a boot it cannot finish.
         db=.cache/long/h200-long.db; run=h200-$stage-${LONG_RUN:-$commit}; seed_long "$db"; limit=${LONG_LIMIT:-560}
         if python3 -m lab ls --db "$db" "$run" > /dev/null 2>&1; then what=(run --resume "$run")
         elif [ "$stage" = 1m ]; then what=(sweep ladders/h200-1m.yaml --control-only --label "$commit" --name "$run")
         else what=(run "ladders/h200-$stage.yaml" --name "$run"); fi
         { timeout "$limit" python3 -m lab "${what[@]}" --time-budget $((limit - 10)) --db "$db"; echo "lab exit $?"
           python3 -m lab ls --db "$db" "$run"; } > "$OUT/$stage.txt" 2>&1
         cp "$db" "$OUT/h200-long.db"; tar czf "$OUT/triton.tgz" -C .cache/long triton
         [ -d "runs/$run" ] && tar czf "$OUT/$stage-logs.tgz" "runs/$run" ;;
    long-cal) # 3 control boots of ladders/h200-long.yaml after a warm-up, into the same store (seed_long):
         # the noise of each key metric on this host, with which `lab report` judges the run again
         db=.cache/long/h200-long.db; run=h200-long-${LONG_RUN:-$commit}; seed_long "$db"
         { timeout "${LONG_LIMIT:-560}" python3 -m lab calibrate ladders/h200-long.yaml --boots 3 --db "$db" \
             --name "h200-long-cal-$commit"; echo "lab calibrate exit $?"
           COLUMNS=200 python3 -m lab compare --db "$db" "$run:C0ctl" "$run:L1mnbt4k"; } > "$OUT/long-cal.txt" 2>&1
         cp "$db" "$OUT/h200-long.db"; tar czf "$OUT/triton.tgz" -C .cache/long triton ;;
    served) for sw in 5 0.5 0.2; do
              ( for _ in $(seq 120); do p=$(pgrep -f "lab.engine serve" | head -1); [ -n "$p" ] && break; sleep 0.5; done
                [ -n "$p" ] && [ -x /tmp/site/bin/py-spy ] && /tmp/site/bin/py-spy record --pid "$p" --rate 200 --threads \
                  --gil --nonblocking --format raw -o "$OUT/served_sw$sw.pyspy" ) > "$OUT/pyspy_sw$sw.log" 2>&1 &
              timeout 170 python3 -m lab.engine bench --model dummy:llama3-8b --dtype bfloat16 --max-model-len 8192 \
                --max-num-batched-tokens 8192 --max-num-seqs 256 --prompt-tokens 1024 --decode-tokens 256 \
                --prefill-lengths "" --concurrency 64 --repeats 3 --reference none --throughput "" --served \
                --gil-switch-interval-ms $sw --json "$OUT/served_sw$sw.json" > "$OUT/served_sw$sw.txt" 2>&1
              wait; done ;;
    smollm2) timeout 80 python3 -m lab.engine bench --model dummy:smollm2-135m --dtype bfloat16 \
            --max-model-len 8192 --max-num-batched-tokens 8192 --max-num-seqs 256 --prompt-tokens 1024 \
            --decode-tokens 64 --concurrency 32 --prefill-lengths 2048,8000 --repeats 2 --throughput 64,256 \
            --throughput-tokens 1024 --json "$OUT/smollm2_bf16.json" > "$OUT/smollm2_bf16.txt" 2>&1 ;;
  esac
  echo "$stage exit $?" >> "$OUT/env.txt"
}
# A device call returns at most 8 files: a stage that wrote several leaves them as one archive.
pack() {
  local stage=$1 before=$2 made f
  mapfile -t made < <(ls "$OUT" | grep -vxF -f "$before")
  for f in "${made[@]}"; do case $f in *.txt) echo "== $stage: $f"
    grep -E "figure:|Model name|│ (decode|prefill|mixed)|passed|failed|Error|exit|reject|keep|inconclusive|resume|TTFT|ttft" "$OUT/$f" \
      | grep -v -i warn | tail -40 | cut -c 1-220 ;; esac; done
  if [ "${#made[@]}" -gt 1 ]; then tar czf "$OUT/$stage.tgz" -C "$OUT" "${made[@]}" && (cd "$OUT" && rm -f "${made[@]}"); fi
}
# A stage named bg:STAGE (a CPU stage pinned to cores 0 and 1) runs beside the others, which are kept
# off those cores and their hyperthread siblings, so one call measures a quiet 2-core host and the GPU.
bg=()
for stage in $stages; do [ "${stage#bg:}" != "$stage" ] && bg+=("${stage#bg:}"); done
if [ "${#bg[@]}" -gt 0 ]; then
  ( OUT=/tmp/bgout; mkdir -p "$OUT"; for stage in "${bg[@]}"; do run_stage "$stage"; done ) > /tmp/bg.log 2>&1 &
  bgpid=$!
  fg=$(python3 -c 'import os
near = set()
for c in (0, 1):
    for part in open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read().strip().split(","):
        a, _, b = part.partition("-"); near.update(range(int(a), int(b or a) + 1))
print(",".join(str(c) for c in sorted(os.sched_getaffinity(0) - near)))')
  echo "background ${bg[*]} on cores 0,1; the rest on $fg" >> "$OUT/env.txt"
  [ -n "$fg" ] && taskset -pc "$fg" $$ > /dev/null
fi
for stage in $stages; do
  [ "${stage#bg:}" != "$stage" ] && continue
  ls "$OUT" > /tmp/h200-before.txt
  run_stage "$stage"
  pack "$stage" /tmp/h200-before.txt
done
if [ "${#bg[@]}" -gt 0 ]; then
  wait "$bgpid"
  for f in /tmp/bgout/*.txt; do echo "== bg: $f"
    grep -E "exit|reject|keep|inconclusive|no effect|undecided|sd|SD" "$f" | grep -v -i warn | tail -40 | cut -c 1-220; done
  cat /tmp/bgout/env.txt >> "$OUT/env.txt"
  cp /tmp/bg.log /tmp/bgout/ && tar czf "$OUT/bg.tgz" -C /tmp/bgout .
fi
cat "$OUT/env.txt"
true

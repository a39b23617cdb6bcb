#!/usr/bin/env bash
# The one device runner: named steps, each under its own time limit, in one call to the GPU machine.
#
#   bash benchmarks/device.sh tests attention moe e2e          # steps in the order given
#   OUT=$OUT XSTAGE_GIT_COMMIT=$sha bash benchmarks/device.sh calibration tests
#
# Steps (each writes under $OUT/<step>/, then everything is packed into $OUT/device.tgz, since at most
# 8 files come back from a device call):
#   env          GPU, driver, torch/triton/cuDNN/diffusers versions; the host's load, steal, GPU neighbours, core jitter
#   tests        the gpu/multigpu-marked tests (scripts/gpu_tests.sh; TESTS="tests/ops ..." narrows them)
#   calibration  burst-kernel build, calibration GPU tests, bench_calibration.py (local + host targets)
#   attention    bench_attention_a2a.py (ATTN_ARGS adds options)
#   moe          bench_moe_combine.py at the NucleusMoE and HiDream shapes (MOE_ARGS adds options)
#   moe-world1   test_ep_world1.py's GPU tests, then bench_moe_world1.py: NucleusMoE's full-size MoE layer at
#                world 1, diffusers' layer vs the EP world-1 fused path, eager and compiled (MOE_WORLD1_ARGS)
#   parallelize  bench_parallelize_flux.py (FLUX step, world 1 vs 2 ranks sharing the GPU)
#   flux-step    bench_flux_step.py (plain diffusers FLUX step, tiny and full size)
#   regime       bench_xstage_regime.py: host-target calibration, attention and MoE sweeps vs the X-Stage model
#   (FA4)        one call: carry [".whl-fa4"] (benchmarks/pack_site.sh packs FA4 + the CuTe DSL into one ~60 MB
#                file) with WHEEL_DIRS=none; device_env.sh unpacks it into /tmp/site, no step needed. The two
#                steps below are the older two-call way, for when that file is not built:
#   fa4-stash    call 1 of ../shared/tools/device-bigwheel.sh for the CuTe DSL wheels (carry .whl-a .whl):
#                keeps the first half of the 92 MB wheel and the small wheels in /tmp/bigwheel
#   fa4-install  call 2, on the same warm machine (carry .whl-b .whl-fe .whl-s1): joins the wheel and installs
#                flash-attn-4 and the CuTe DSL (and cudnn-frontend where carried) in ONE pip call into /tmp/site,
#                then drops the stash (later calls on the machine use /tmp/site as it is)
#   window       the peer-window GPU tests and bench_attention_a2a.py --window (WINDOW_ARGS adds options,
#                e.g. --graph for CUDA-graph timing, --pre-a2a for the pre-attention All-to-All rows,
#                --pre-a2a-only for those alone)
#   e2e          bench_e2e.py per model in E2E_MODELS (default "flux"); E2E_<MODEL>_ARGS override the
#                options, E2E_S the time budget of each
#   compile-variants  bench_compile_variants.py (CV_ARGS: model, variants): which torch.compile setup is fastest
#   lora         issue 40: bench_serving.py lora (LORA_ARGS; default fused rows) + tests/server/test_server_lora_gpu.py
#                (carry [".whl", ".whl-ao"], WHEEL_DIRS=".whl .whl-ao"; ~8 min: LORA_BENCH_S / LORA_TESTS_S)
#   fp8-attention  issue 41's FP8 attention in one call (carry [".whl-fp8attn"] with WHEEL_DIRS=.whl-fp8attn: diffusers
#                & co, torchao, nvidia-cudnn-frontend, sageattention): the GPU tests of the 8-bit kernels, of FP8 at
#                sp = 2 (two processes on the GPU), of the FP8 feature (its fused row quantization too) and of the
#                FP8 expert MLPs (FP8_ATTN_TESTS_S, default 360 s), then
#                bench_fp8_error.py --attention: every kernel's error vs fp32 and time on the FLUX / Wan / NucleusMoE
#                attention shapes (FP8_ATTN_SHAPES, FP8_ATTN_BENCH_S default 150 s)
#   served-path  bench_serving.py served-path: bare call vs the server's runner (main thread, worker thread) vs HTTP
#                (SERVED_PATH_ARGS; default NucleusMoE, 4 steps, regional compile, then 16 adjacent bare / served
#                pairs: the served / bare ratio's 95 % interval against 1.02)
#   transport    bench_serving.py transport: keep-alive HTTP round trips by answer size, per listener (in-process server)
#   vae-decode   bench_vae_decode.py: the Qwen-Image / Wan VAE decode of one frame as a 2-D network
#                (features.one_frame_vae), eager and compiled, vs diffusers' (VAE_ARGS)
#   row-quant    the one-pass row-wise FP8 quantizer (ops.fp8_rows): its GPU test (bit for bit its reference at
#                FLUX's shapes), then bench_row_quant.py: it vs Inductor (default, triton.multi_kernel) vs a copy
#                (ROWQ_ARGS)
#   fp8-e2e      issue 41's e2e rows of one model, resumable over calls to one warm machine (carry [".whl-fp8attn",
#                ".whl-video"] with WHEEL_DIRS=".whl-fp8attn .whl-video"; FA4 from an earlier call's .whl-fa4 stays in
#                /tmp/site): bench_e2e.py --compile regional --compiled-only on FP8_E2E_MODEL (full-flux) at
#                FP8_E2E_STEPS (28) with the contenders FP8_E2E_ROWS in that order (default every FP8 row, the peer's
#                first), rows kept in /tmp/fp8-e2e-<model> and resumed by the next call (a row the budget skips runs
#                then; FP8_E2E_FRESH=1 starts over); FP8_E2E_S (560) the limit, FP8_E2E_EXTRA more options
#   fp8-error    bench_fp8_error.py per model in FP8_ERROR_MODELS (default "full-flux"): latents vs an fp32 run,
#                4 seeds, written after every seed (FP8_ERROR_<MODEL>_ARGS override the options, with - as _ in the name;
#                FP8_ERROR_S (540) the whole step's budget, shared out in order)
#   fp8-probe    bench_fp8_error.py probe-rows: every linear shape of the FP8 models through torchao's row-wise FP8 linear at 1, 2,
#                16 and 4096 rows: which torch's FP8 GEMM refuses (carry [".whl-fp8attn"]; ~1 min; FP8_PROBE_MODELS)
#   cudnn-binding  bench_cudnn_fp8_binding.py: the host time of one cuDNN FP8 attention call by how its operands are
#                bound (tensor-keyed, by address, uid -> tensor, ordered), at FLUX's shape (carry [".whl-fp8attn"] with
#                WHEEL_DIRS=.whl-fp8attn; CUDNN_BINDING_ARGS adds options; ~1 min)
#   sync-points  bench_e2e.py sync-points: every synchronizing CUDA operation of one warm call, by the line that asked
#                (SYNC_ARGS; default NucleusMoE 4 steps, xstage, regional compile)
#   png          bench_serving.py png: the server's PNG encode on its own thread, one-join vs the old chained copies
#   load         bench_serving.py alone (the serving step's load test; LOAD_ARGS, LOAD_S)
#   batch-invariance  bench_serving.py batch-invariance: is a batched bf16 GEMM row-for-row the one-sample GEMM,
#                per BLAS setting (what lets the server batch images and keep them byte-identical)
#   (worker-thread, the main thread vs a worker thread, is served-path's bare / runner-thread / runner-worker rows)
#   serving      (a) bench e2e FLUX.1-dev 1024^2 28 steps: diffusers, xstage bare and served (eager and
#                compiled, interleaved rounds for the eager ones), xfuser (compiled); (b) bench_serving.py:
#                4 and 16 concurrent FLUX requests at 1024^2 and 512^2, FIFO vs batched, and the batcher's
#                pick. SERVING_E2E_S / SERVING_LOAD_S split its ~420 s (SERVING_LOAD_S=0: (a) alone); SERVING_E2E_ARGS / SERVING_LOAD_ARGS
#                override the options
# Time limits: <STEP>_S (e.g. TESTS_S=300, E2E_S=400); the defaults below fit one 10-minute call only for
# a few steps: pick the steps a call needs. Carry .whl (diffusers, transformers, ... wheels) when a step
# needs them; benchmarks/device_env.sh installs them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.gpu_out}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
. benchmarks/device_env.sh
export XSTAGE_DIT_CACHE="${XSTAGE_DIT_CACHE:-/tmp/xstage-cache}"
export XSTAGE_GIT_COMMIT="${XSTAGE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
py="${PYTHON:-python3}"

pack() { tar -czf "$OUT/device.tgz" -C "$OUT" --exclude device.tgz . 2>/dev/null; }
limit() { local var="${1^^}_S"; var="${var//-/_}"; echo "${!var:-$2}"; }

step_env() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  # How busy the host is besides us: its load, CPU time stolen by a hypervisor, other processes on the GPU, and
  # how steady one core's speed is (a host-bound call, NucleusMoE's, is only as steady as this).
  echo "loadavg $(cat /proc/loadavg) nproc $(nproc)"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
  "$py" - <<'EOF'
import statistics, time
def cpu():
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]
a = cpu(); ms = []
for _ in range(40):
    t0 = time.perf_counter(); sum(i * i for i in range(200_000)); ms.append(1e3 * (time.perf_counter() - t0))
b = cpu(); d = [y - x for x, y in zip(a, b)]
print(f"host: one-core loop {statistics.median(ms):.1f} ms median, {min(ms):.1f}-{max(ms):.1f} over 40; "
      f"steal {100 * d[7] / max(1, sum(d)):.2f} % iowait {100 * d[4] / max(1, sum(d)):.2f} % of all CPU time meanwhile")
EOF
  "$py" - <<'EOF'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
for name in ("triton", "diffusers", "transformers", "xfuser", "flash-attn-4", "nvidia-cudnn-frontend"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
}

step_tests() {
  # shellcheck disable=SC2086
  OUT="$1" timeout "$(limit tests 300)" bash scripts/gpu_tests.sh ${TESTS:-}
}

step_calibration() {
  timeout "$(limit calibration 200)" bash -c "
    '$py' -c 'import torch; from xstage_dit.calibration.csrc.burst import library_for; print(library_for(torch.device(\"cuda\", 0)).path)' &&
    '$py' -m pytest -q -p no:cacheprovider -o addopts='' -m gpu tests/calibration &&
    '$py' benchmarks/bench_calibration.py --out '$1' --targets local,host"
}

step_attention() {
  # shellcheck disable=SC2086
  timeout "$(limit attention 300)" "$py" benchmarks/bench_attention_a2a.py --out-dir "$1" --commit "$XSTAGE_GIT_COMMIT" \
    ${ATTN_ARGS:-}
}

site_dsl=/tmp/site
# The CuTe DSL wheels add dsl_packages through a .pth file, which a --target install does not run.
export PYTHONPATH="$PYTHONPATH:$site_dsl:$site_dsl/nvidia_cutlass_dsl/dsl_packages"

step_fa4_stash() {
  # STASH_DIRS: more wheel dirs to keep for call 2 (what does not fit beside .whl-b there), e.g. ".whl-s1"
  mkdir -p /tmp/bigwheel && cp .whl-a/* .whl/*.whl /tmp/bigwheel/ && ls /tmp/bigwheel || return 1
  local d
  for d in ${STASH_DIRS:-}; do cp "$d"/*.whl /tmp/bigwheel/ || return 1; done
}

step_fa4_install() {
  local b n
  for b in .whl-b/*.part-ab; do
    n=$(basename "$b" .part-ab)
    [ -f "/tmp/bigwheel/$n.part-aa" ] || { echo "no stash on this machine: run fa4-stash first"; return 3; }
    cat "/tmp/bigwheel/$n.part-aa" "$b" > "/tmp/bigwheel/$n"
  done
  cp .whl-fe/*.whl /tmp/bigwheel/ 2>/dev/null
  # .whl-s1 (apache_tvm_ffi) rides in this call where call 1 has no room for it (checkout 5.7 MB, 2026-12-05).
  [ -d .whl-s1 ] && cp .whl-s1/*.whl /tmp/bigwheel/ 2>/dev/null
  # --upgrade: device_env.sh already installed the stash's other wheels into the same folder before the join,
  # and without it pip skips the existing nvidia_cutlass_dsl folder, leaving the DSL without its CUDA-13
  # libraries ("No CTK flavor installed", H200 2026-12-03). One call, all wheels, replaced together.
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site_dsl" /tmp/bigwheel/*.whl \
    2>&1 | grep -v -i warning
  "$py" -c "import flash_attn.cute, torch; print('fa4 ok; torch cuDNN', torch.backends.cudnn.version())" || return 1
  "$py" -c "import cudnn; print('cudnn-frontend, cuDNN', cudnn.backend_version())" || echo "no cudnn-frontend (not carried)"
  # Installed in /tmp/site for the machine's later calls: the stash goes, so they do not reinstall 100 MB each.
  rm -rf /tmp/bigwheel
}

step_window() {
  timeout "$(limit window 420)" bash -c "
    '$py' -m pytest -q -rs --tb=short -p no:cacheprovider -o addopts='' tests/ops/test_attention_window_gpu.py;
    '$py' benchmarks/bench_attention_a2a.py --window --out-dir '$1' --commit '$XSTAGE_GIT_COMMIT' ${WINDOW_ARGS:-}"
}

step_moe() {
  # shellcheck disable=SC2086
  timeout "$(limit moe 200)" "$py" benchmarks/bench_moe_combine.py --out "$1/moe" ${MOE_ARGS:-}
}

step_moe_world1() {
  timeout "$(limit moe-world1 400)" bash -c "
    '$py' -m pytest -q -s -rs --tb=short -p no:cacheprovider -o addopts='' tests/features/test_ep_world1.py -m gpu;
    '$py' benchmarks/bench_moe_world1.py --out-dir '$1' --commit '$XSTAGE_GIT_COMMIT' ${MOE_WORLD1_ARGS:-}"
}

step_parallelize() {
  timeout "$(limit parallelize 200)" "$py" benchmarks/bench_parallelize_flux.py --out "$1"
}

step_flux_step() {
  timeout "$(limit flux-step 200)" "$py" benchmarks/bench_flux_step.py --out "$1/flux-step"
}

step_regime() {
  timeout "$(limit regime 300)" "$py" benchmarks/bench_xstage_regime.py --out-dir "$1" ${REGIME_ARGS:-}
}

step_e2e() {
  local m args var
  for m in ${E2E_MODELS:-flux}; do
    var="E2E_${m^^}_ARGS"
    case "$m" in
      flux) args="--model full-flux --num-prompts 2 --rounds 2 --compile" ;;
      nucleusmoe) args="--model full-nucleusmoe --num-prompts 2 --steps 4 --rounds 3 --repeats 3 --compile" ;;
      wan) args="--model full-wan --num-prompts 1 --steps 2 --rounds 1 --compile" ;;
      *) echo "unknown e2e model $m (flux, nucleusmoe, wan)"; return 2 ;;
    esac
    echo "[device.sh] e2e $m: ${!var:-$args}"
    # shellcheck disable=SC2086
    timeout -k 10 "$(limit e2e 400)" "$py" benchmarks/bench_e2e.py ${!var:-$args} --device cuda \
      --time-budget-s "$(( $(limit e2e 400) - 30 ))" --out-dir "$1" 2>&1 | grep -v "^ *$"
  done
}

step_serving() {
  local e2e_s load_s
  e2e_s="${SERVING_E2E_S:-245}"
  load_s="${SERVING_LOAD_S:-165}"
  local e2e_args="--model full-flux --steps 28 --num-prompts 1 --rounds 2 --compile regional --compile-estimate-s 40
    --contenders diffusers,xstage-serial,xstage-served,xfuser-usp,xfuser-runner"
  echo "[device.sh] serving e2e: ${SERVING_E2E_ARGS:-$e2e_args}"
  # shellcheck disable=SC2086
  timeout -k 10 "$e2e_s" "$py" benchmarks/bench_e2e.py ${SERVING_E2E_ARGS:-$e2e_args} --device cuda \
    --time-budget-s "$(( e2e_s - 25 ))" --out-dir "$1" 2>&1 | grep -v "^ *$"
  local rc_e2e=${PIPESTATUS[0]}
  [ "$load_s" -eq 0 ] && return "$rc_e2e"  # SERVING_LOAD_S=0: the e2e part alone
  load_test "$1" "$load_s" "${SERVING_LOAD_ARGS:-}"
  local rc_load=$?
  [ "$rc_e2e" -eq 0 ] && [ "$rc_load" -eq 0 ]
}

load_test() {
  # bench_serving.py into $1 within $2 seconds; $3 overrides the options. Eager: compile moves FIFO and
  # batched alike, and its minutes are better spent on requests.
  local args="${3:-"--model full-flux --sizes 512x512,1024x1024 --concurrency 4,16 --steps 8 --compile off"}"
  echo "[device.sh] serving load: $args"
  # shellcheck disable=SC2086
  timeout -k 10 "$2" "$py" benchmarks/bench_serving.py $args --device cuda --time-budget-s "$(( $2 - 40 ))" \
    --out "$1" 2>&1 | grep -v "^ *$"
  return "${PIPESTATUS[0]}"
}

step_load() {
  # The load test alone (the serving step's part (b)): LOAD_ARGS override, LOAD_S its time limit.
  load_test "$1" "$(limit load 240)" "${LOAD_ARGS:-}"
}

step_batch_invariance() {
  timeout -k 10 "$(limit batch-invariance 120)" "$py" benchmarks/bench_serving.py batch-invariance --out-dir "$1"
}

step_served_path() {
  # shellcheck disable=SC2086
  timeout -k 10 "$(limit served-path 240)" "$py" benchmarks/bench_serving.py served-path --out-dir "$1" ${SERVED_PATH_ARGS:---pairs 16}
}

step_transport() {
  timeout -k 10 "$(limit transport 90)" "$py" benchmarks/bench_serving.py transport --out-dir "$1" --tag gpu-host
}

step_png() {
  timeout -k 10 "$(limit png 120)" "$py" benchmarks/bench_serving.py png --out-dir "$1" --tag gpu-host
}

step_sync_points() {
  # shellcheck disable=SC2086
  timeout -k 10 "$(limit sync-points 240)" "$py" benchmarks/bench_e2e.py sync-points --out-dir "$1" --tag gpu ${SYNC_ARGS:-}
}

step_vae_decode() {
  # shellcheck disable=SC2086
  timeout -k 10 "$(limit vae-decode 300)" "$py" benchmarks/bench_vae_decode.py --out-dir "$1" --tag gpu ${VAE_ARGS:-}
}

step_row_quant() {
  OUT="$1" timeout -k 10 "${ROWQ_TESTS_S:-120}" bash scripts/gpu_tests.sh -s tests/ops/test_fp8_rows_gpu.py
  local rc_tests=$?
  # shellcheck disable=SC2086
  timeout -k 10 "$(limit row-quant 240)" "$py" benchmarks/bench_row_quant.py --out-dir "$1" --tag gpu ${ROWQ_ARGS:-}
  local rc_bench=$?
  [ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
}

step_compile_variants() {
  # shellcheck disable=SC2086
  timeout -k 10 "$(limit compile-variants 300)" "$py" benchmarks/bench_compile_variants.py --out-dir "$1" \
    ${CV_ARGS:---model flux --variants eager,regional,full,regional+qkv,regional+tuned --vae}
}

step_fp8_attention() {
  OUT="$1" timeout -k 10 "${FP8_ATTN_TESTS_S:-360}" bash scripts/gpu_tests.sh -s tests/ops/test_attention_fp8_gpu.py \
    tests/features/test_fp8_sp_gpu.py tests/features/test_fp8.py tests/features/test_fp8_fused.py \
    tests/features/test_fp8_few_rows.py tests/ops/test_attention_padded_gpu.py \
    tests/ops/test_fp8_rows_gpu.py tests/ops/test_moe_fp8.py tests/calibration/test_kernel_sweep_gpu.py
  local rc_tests=$?
  timeout -k 10 "${FP8_ATTN_BENCH_S:-150}" "$py" benchmarks/bench_fp8_error.py --attention \
    --attention-shapes "${FP8_ATTN_SHAPES:-flux,wan,nucleus}" --out-dir "$1" --tag "${FP8_ATTN_TAG:-gpu}"
  local rc_bench=$?
  [ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
}

step_fp8_e2e() {
  local model="${FP8_E2E_MODEL:-full-flux}" limit_s dir prev rows
  rows="diffusers-fp8,xstage-fp8-served,xstage-served,xstage-fp8-attn-served,xstage-fp8,xstage-fp8-attn"
  rows="${FP8_E2E_ROWS:-$rows,xstage-calibrated}"
  limit_s="$(limit fp8-e2e 560)"
  dir="/tmp/fp8-e2e-$model"
  [ "${FP8_E2E_FRESH:-0}" = 1 ] && rm -rf "$dir"
  mkdir -p "$dir"
  prev=$(ls "$dir"/e2e-*.json 2>/dev/null | head -1)
  # shellcheck disable=SC2086
  timeout -k 10 "$limit_s" "$py" benchmarks/bench_e2e.py --model "$model" --steps "${FP8_E2E_STEPS:-28}" \
    --num-prompts 1 --compile regional --compiled-only --device cuda --out-dir "$dir" \
    --contenders "$rows" \
    --time-budget-s "$(( limit_s - 20 ))" ${prev:+--resume "$prev"} ${FP8_E2E_EXTRA:-} 2>&1 | grep -v -i "warn"
  local rc=${PIPESTATUS[0]}
  cp -r "$dir"/. "$1"/
  return "$rc"
}

step_fp8_error() {
  local m var left args start=$SECONDS total
  total="$(limit fp8-error 540)"
  for m in ${FP8_ERROR_MODELS:-full-flux}; do
    var="FP8_ERROR_${m^^}_ARGS"; var="${var//-/_}"
    case "$m" in
      full-flux) args="--steps 28 --variants bf16,fp8-row,fp8-row+cudnn-fp8" ;;
      full-wan) args="--frames 21 --steps 2 --variants bf16,fp8-row,fp8-row+cudnn-fp8" ;;
      full-nucleusmoe) args="--steps 4 --variants bf16,fp8-row,fp8-tensor" ;;
      *) args="" ;;
    esac
    left=$(( total - (SECONDS - start) ))
    [ "$left" -gt 30 ] || { echo "[device.sh] fp8-error: no time left for $m"; return 1; }
    echo "[device.sh] fp8-error $m: ${!var:-$args} (${left} s)"
    # shellcheck disable=SC2086
    timeout -k 10 "$left" "$py" benchmarks/bench_fp8_error.py --model "$m" --seeds 4 ${!var:-$args} \
      --time-budget-s "$(( left - 15 ))" --out-dir "$1" --tag "1xgpu-$XSTAGE_GIT_COMMIT" 2>&1 | grep -v -i "warn"
  done
}

# The three FP8 models, and the families whose one-row layers (timestep, pooled text, output modulation) also
# contract more than they output, as NucleusMoE's refused layer does (a meta-device scan of every full-size model).
FP8_PROBE_DEFAULT="full-nucleusmoe,full-flux,full-wan,full-cogvideox,full-hunyuanvideo,full-hunyuanvideo15"
FP8_PROBE_DEFAULT="$FP8_PROBE_DEFAULT,full-lumina2,full-z-image"
step_fp8_probe() {
  timeout -k 10 "$(limit fp8-probe 120)" "$py" benchmarks/bench_fp8_error.py probe-rows --out-dir "$1" --tag "1xgpu-$XSTAGE_GIT_COMMIT" \
    --models "${FP8_PROBE_MODELS:-$FP8_PROBE_DEFAULT}"
}

step_cudnn_binding() {
  # shellcheck disable=SC2086
  timeout -k 10 "$(limit cudnn-binding 120)" "$py" benchmarks/bench_cudnn_fp8_binding.py --out-dir "$1" --tag gpu \
    ${CUDNN_BINDING_ARGS:-}
}

step_lora() {
  # Issue 40: the LoRA latency rows (LORA_ARGS; default the fused mode's rows beside the no-LoRA request of the
  # same build; unfused rows are in benchmarks/results/lora/), then the LoRA GPU tests (the forced out-of-memory
  # request, the compiled server switching adapters in each mode).
  # shellcheck disable=SC2086
  timeout -k 10 "${LORA_BENCH_S:-260}" "$py" benchmarks/bench_serving.py lora --out-dir "$1" \
    ${LORA_ARGS:---model full-flux --size 1024x1024 --steps 28 --rank 64 --compile regional --requests 4 --modes fused --no-baseline}
  local rc_bench=$?
  OUT="$1" timeout -k 10 "${LORA_TESTS_S:-240}" bash scripts/gpu_tests.sh -s tests/server/test_server_lora_gpu.py
  local rc_tests=$?
  [ "$rc_bench" -eq 0 ] && [ "$rc_tests" -eq 0 ]
}

status=0
for step in "$@"; do
  fn="step_${step//-/_}"
  if ! declare -F "$fn" >/dev/null; then
    echo "[device.sh] unknown step '$step' (env tests calibration attention fa4-stash fa4-install window moe moe-world1 parallelize flux-step regime e2e serving load served-path transport png sync-points vae-decode row-quant fp8-e2e fp8-error fp8-probe cudnn-binding compile-variants batch-invariance fp8-attention lora)" >&2
    exit 2
  fi
  dir="$OUT/$step"; mkdir -p "$dir"
  echo "== [device.sh] $step (limit $(limit "$step" 300) s, commit $XSTAGE_GIT_COMMIT)"
  start=$SECONDS
  "$fn" "$dir" 2>&1 | tee "$dir/$step.log"
  rc=${PIPESTATUS[0]}
  echo "== [device.sh] $step: exit $rc after $(( SECONDS - start )) s (124/137 = its time limit)"
  [ "$rc" -ne 0 ] && status=1
  pack
done
exit "$status"

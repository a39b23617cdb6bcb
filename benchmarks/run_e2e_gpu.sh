#!/usr/bin/env bash
# End-to-end latency benchmarks of issue 8 on a GPU machine, in ONE call that budgets itself.
#
# Runs xstage_dit/bench/e2e.py for FLUX.1-dev (1024², 28 steps), NucleusMoE image (1024²) and Wan 2.1 14B
# (480p, 81 frames): full-size architectures, random weights built on the GPU in bf16. Each model runs in
# its own process with a soft budget (bench_e2e.py reports contenders that do not fit as
# "skipped: time budget") and a hard timeout (so one model never eats the others' time). At most 8 files
# come back from a device call, so $OUT gets (refreshed after every model, so a cut-short call keeps
# what finished):
#   $OUT/e2e-results.tgz     results/e2e-<model>-1x<gpu>.{json,md,png} and logs/<model>.log
#   $OUT/e2e-<model>-1x<gpu>.md   each model's table, readable at once
#   $OUT/run_e2e.log         this script's output
# Then here:  tar -xzf <files_at>/e2e-results.tgz -C /tmp/e2e && cp /tmp/e2e/results/e2e-* benchmarks/results/
#
# Prepare on the development machine, from the repository root (pure-Python wheels, no dependencies):
#   bash benchmarks/run_e2e_gpu.sh prepare          # adds xfuser 0.7.0 and its small deps to ./.whl
#   (diffusers' wheel comes from shared/tools/device-wheels.sh diffusers==0.42.1, also into ./.whl)
# Then, on the device (the checkout copied to .carry-bench, wheels in .whl at the repository root):
#   run(command="XSTAGE_GIT_COMMIT=<sha> bash benchmarks/run_e2e_gpu.sh", carry=[".whl"], timeout_s=500)
# (from a checkout where this branch is merged; else copy the worktree to .carry-bench, carry it too and
# start the command with "cd .carry-bench &&"). The tree travels without .git: XSTAGE_GIT_COMMIT names it.
#
# Knobs (environment): E2E_TOTAL_S (whole call, default 440), E2E_FLUX_S / E2E_NUCLEUS_S / E2E_WAN_S (soft
# budgets per model, defaults 200 / 70 / 150), E2E_FLUX_PROMPTS (2), E2E_NUCLEUS_PROMPTS (2),
# E2E_NUCLEUS_STEPS (4), E2E_WAN_STEPS (2), E2E_COMPILE_MODELS ("flux": models that also run the torch.compile
# variants), E2E_COMPILE_FLUX (0 drops flux from that list), E2E_FLUX_ROUNDS / E2E_NUCLEUS_ROUNDS / E2E_WAN_ROUNDS
# (--rounds per model, defaults 2 / 4 / 1: interleaved rounds of the eager diffusers/xstage contenders, more where
# a call is short and noisy; 1 = once each, with the A/B/A diffusers-repeat; rounds that no longer fit the soft
# budget are dropped for every contender alike),
# E2E_MODELS (default "nucleusmoe wan flux": the cheap models first, so FLUX's compile variants cannot starve them), WHEEL_DIRS (default: ./.whl and ../.whl), PYTHON (python3).
# A dry run of this script on a CPU: E2E_SIZE=tiny E2E_DEVICE=cpu WHEEL_DIRS=none PYTHON=.venv/bin/python.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ "${1:-}" = "prepare" ]; then
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
    xfuser==0.7.0 yunchang==0.6.4 distvae==0.1.0 beautifulsoup4==4.15.0 soupsieve==4.1.3
  ls -la .whl && du -sh .whl
  exit 0
fi

OUT="${OUT:-$root/.gpu_out}"
py="${PYTHON:-python3}"
size="${E2E_SIZE:-full}"
work="$(mktemp -d)"
mkdir -p "$OUT" "$work/results" "$work/logs"
exec > >(tee -a "$OUT/run_e2e.log") 2>&1
collect() {  # everything so far into the one archive that comes back, plus each table
  tar -czf "$OUT/e2e-results.tgz" -C "$work" results logs
  for f in "$work"/results/e2e-*.md; do [ -f "$f" ] && cp "$f" "$OUT/"; done
}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One X-Stage calibration for the whole call: the first xstage-calibrated contender measures (a few
# seconds), the later models load it.
export XSTAGE_DIT_CACHE="${XSTAGE_DIT_CACHE:-/tmp/xstage-e2e-cache}"

# Carried wheels (diffusers, xfuser and the few packages the device image lacks) into a private site dir.
site="$(mktemp -d)"
wheels=()
for dir in ${WHEEL_DIRS:-"$root/.whl" "$root/../.whl"}; do
  [ -d "$dir" ] && wheels+=("$dir"/*.whl)
done
if [ ${#wheels[@]} -gt 0 ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
    2>&1 | grep -v -i "warning" || true
fi
# The checkout first: xfuser's wheel also installs top-level `benchmarks` and `tests` directories.
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
"$py" - <<'EOF' 2>&1 | tee "$work/logs/env.log"
import importlib.metadata as md, torch
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch", torch.__version__)
for name in ("diffusers", "transformers", "triton", "xfuser", "yunchang"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF

total="${E2E_TOTAL_S:-440}"
start=$SECONDS
# model -> soft budget (s) and options. Fewer prompts/steps than the defaults keep the call inside the
# device budget; the JSON records what was used and the per-step transformer time measured.
declare -A budget=( [flux]="${E2E_FLUX_S:-200}" [nucleusmoe]="${E2E_NUCLEUS_S:-70}" [wan]="${E2E_WAN_S:-150}" )
# Regional compilation (diffusers' compile_repeated_blocks) compiles one block of each kind: tens of
# seconds, not minutes; the estimate only decides what the soft budget still admits.
compile_models=" ${E2E_COMPILE_MODELS:-flux} "
[ "${E2E_COMPILE_FLUX:-1}" = "1" ] || compile_models="${compile_models/ flux / }"
compile_opt() { [[ "$compile_models" == *" $1 "* ]] && echo "--compile --compile-estimate-s ${E2E_COMPILE_ESTIMATE_S:-40}"; }
declare -A opts=(
  [flux]="--model $size-flux --num-prompts ${E2E_FLUX_PROMPTS:-2} --rounds ${E2E_FLUX_ROUNDS:-2} $(compile_opt flux)"
  [nucleusmoe]="--model $size-nucleusmoe --num-prompts ${E2E_NUCLEUS_PROMPTS:-2} --steps ${E2E_NUCLEUS_STEPS:-4} --rounds ${E2E_NUCLEUS_ROUNDS:-4} $(compile_opt nucleusmoe)"
  [wan]="--model $size-wan --num-prompts 1 --steps ${E2E_WAN_STEPS:-2} --rounds ${E2E_WAN_ROUNDS:-1} $(compile_opt wan)"
)
models=(${E2E_MODELS:-nucleusmoe wan flux})
status=0
for i in "${!models[@]}"; do
  m="${models[$i]}"
  left=$(( total - (SECONDS - start) ))
  # Leave the later models at least their own budgets where possible; this one gets the rest, capped.
  later=0
  for m2 in "${models[@]:$((i + 1))}"; do later=$(( later + ${budget[$m2]} )); done
  soft=$(( ${budget[$m]} < left - later ? ${budget[$m]} : left - later ))
  [ "$soft" -lt 30 ] && soft=$(( left < 30 ? left : 30 ))
  if [ "$left" -lt 20 ]; then
    echo "[run_e2e_gpu] $m: not started, ${left}s of the ${total}s call left" | tee "$work/logs/$m.log"
    status=1
    continue
  fi
  hard=$(( soft + 45 < left ? soft + 45 : left ))  # grace for the contender running when the budget ends
  echo "[run_e2e_gpu] $m: soft budget ${soft}s, hard limit ${hard}s (${left}s left)"
  # shellcheck disable=SC2086
  timeout -k 10 "$hard" "$py" xstage_dit/bench/e2e.py ${opts[$m]} --device "${E2E_DEVICE:-cuda}" --time-budget-s "$soft" \
    --out-dir "$work/results" > "$work/logs/$m.log" 2>&1
  rc=$?
  grep -E "^\[bench\]|Error|error" "$work/logs/$m.log" | tail -25
  [ "$rc" -ne 0 ] && { echo "[run_e2e_gpu] $m: exit $rc (124/137 = hard limit; partial results kept)"; status=1; }
  collect
done
for f in "$work"/results/e2e-*.md; do [ -f "$f" ] && { echo; cat "$f"; }; done
echo "[run_e2e_gpu] done in $(( SECONDS - start ))s"
exit $status

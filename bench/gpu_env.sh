# Sourced by bench/gpu_run.sh and bench/gpu_train.sh, which set ROOT (the checkout): on the GPU
# image the tree runs uninstalled, so it becomes importable as the package yoso_serve (pyproject's
# package-dir) through a link on PYTHONPATH, and both scripts share one extension cache, so a
# second call on a warm machine reuses the first one's CUDA build.
PKG=$(mktemp -d)
ln -s "$ROOT" "$PKG/yoso_serve"
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/yoso_ext MAX_JOBS=${MAX_JOBS:-16}
# Both calls build for the device's own architecture only, so the second finds the first's build
# (a different TORCH_CUDA_ARCH_LIST would change the cache key and rebuild).
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  arch=$("${PY:-python3}" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null) &&
    export TORCH_CUDA_ARCH_LIST=$arch
fi

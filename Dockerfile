# yoso-serve image. GPU (default): CUDA runtime base, the CUDA build of torch, kernels compiled
# for sm_80/86/89/90 in a CUDA devel stage. CPU: the same steps on Debian bookworm-slim.
#   docker build -t yoso-serve:gpu .                       docker run --gpus all -p 8080:8080 yoso-serve:gpu
#   docker build -t yoso-serve:cpu --build-arg FLAVOR=cpu .  docker run -p 8080:8080 yoso-serve:cpu
# The install logic lives in deploy/install.sh, which CI runs outside Docker; tests/deploy/test_docker_engine.py
# builds the CPU flavor and runs it on a real engine.
# Needs BuildKit (Docker 23+, or DOCKER_BUILDKIT=1 on 20.10) and no registry beyond the bases: there is no
# `# syntax=` line, so the engine's own Dockerfile frontend runs (a syntax line would pull one).
# pip sources other than PyPI (a mirror, a wheel folder served over HTTP, credentials) come in as a
# pip.conf secret, and the CA bundle that a TLS-intercepting proxy needs as pip-ca (pip.conf then says
# `cert = /run/secrets/pip-ca`): no layer keeps them and no cache key includes them.
#   docker build --secret id=pip.conf,src=$HOME/.config/pip/pip.conf [--secret id=pip-ca,src=CA.pem] ...
# torch 2.13's PyPI build is CUDA 13, so nvcc must be 13.x (needs NVIDIA driver >= 580).
# Builder and runtime share one OS per flavor, so the venv's python3 has the same path in both.
# GPU: Ubuntu 24.04 (python3 3.12; 22.04's 3.10 is too old for transformers 5, a dependency of the
# default model). CPU: Debian bookworm-slim (python3 3.11), the base TEI ships its CPU image on.
ARG FLAVOR=gpu
ARG CUDA_VERSION=13.0.0
ARG UBUNTU_VERSION=24.04
ARG DEBIAN_VERSION=bookworm-slim
# Also set at run time: torch's loader compares the build flags and would otherwise try to rebuild.
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build-gpu
FROM debian:${DEBIAN_VERSION} AS build-cpu
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime-gpu
FROM debian:${DEBIAN_VERSION} AS runtime-cpu

# Everything the service reads is installed under /opt/yoso, the one folder the runtime copies.
# hadolint ignore=DL3006
FROM build-${FLAVOR} AS builder
ARG FLAVOR
ARG TORCH_INDEX_URL=auto
ARG TORCH_CUDA_ARCH_LIST
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/yoso/venv/bin:$PATH \
    CUDA_HOME=/usr/local/cuda \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    TORCH_EXTENSIONS_DIR=/opt/yoso/torch_extensions \
    YOSO_CACHE_DIR=/opt/yoso/cache \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# python3-dev and g++ compile the C++ extension (through ccache, whose wrappers lack the name torch calls,
# c++); nvcc comes with the devel base.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ccache \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf ../../bin/ccache /usr/lib/ccache/c++ \
 && python3 -m venv /opt/yoso/venv
# torch first, in a layer of its own (the largest), which a change to the code leaves cached.
COPY deploy/install.sh deploy/requirements.lock.txt /src/deploy/
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip.conf,target=/etc/pip.conf --mount=type=secret,id=pip-ca \
    TORCH_INDEX_URL="${TORCH_INDEX_URL}" bash /src/deploy/install.sh "--${FLAVOR}" --torch-only --python /opt/yoso/venv/bin/python /src
COPY . /src
# The kernels compile through ccache (its cache a cache mount): after a change to the code, only kernel
# sources that changed compile again. Through Debian's c++ wrapper first on PATH, not torch's own "ccache c++"
# (TORCH_NO_COMPILER_WRAPPER): the build file must name the compiler as the runtime's loader does, or it rebuilds.
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=cache,target=/root/.cache/ccache \
    --mount=type=secret,id=pip.conf,target=/etc/pip.conf --mount=type=secret,id=pip-ca \
    PATH="/usr/lib/ccache:$PATH" CCACHE_DIR=/root/.cache/ccache TORCH_NO_COMPILER_WRAPPER=1 \
    TORCH_INDEX_URL="${TORCH_INDEX_URL}" \
    bash /src/deploy/install.sh "--${FLAVOR}" --python /opt/yoso/venv/bin/python /src

# hadolint ignore=DL3006
FROM runtime-${FLAVOR} AS runtime
ARG TORCH_CUDA_ARCH_LIST
# No compiler in this stage (the kernels were built above): TORCH_DONT_CHECK_COMPILER_ABI keeps torch's
# loader from looking for one, and warning that it found none, at every start.
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/yoso/venv/bin:$PATH \
    CUDA_HOME=/usr/local/cuda \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    TORCH_EXTENSIONS_DIR=/opt/yoso/torch_extensions \
    YOSO_CACHE_DIR=/opt/yoso/cache \
    YOSO_HOST=0.0.0.0 \
    YOSO_PORT=8080 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    HOME=/home/yoso \
    TORCH_DONT_CHECK_COMPILER_ABI=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# libgomp1: the C++ extension's OpenMP runtime.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --home-dir /home/yoso --shell /usr/sbin/nologin yoso
COPY --from=builder /opt/yoso /opt/yoso
# torch's extension loader takes a lock file next to the build, so that folder is the user's.
COPY --from=builder --chown=10001:10001 /opt/yoso/torch_extensions /opt/yoso/torch_extensions
USER 10001:10001
WORKDIR /home/yoso
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('YOSO_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["yoso-serve"]

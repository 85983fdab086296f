#!/usr/bin/env bash
# System packages the test suite uses: promtool and the prometheus binary (config checks and the
# scrape integration test); dockerd with a docker CLI, and debootstrap (the image built and run on a
# real engine, tests/deploy/test_docker_engine.py). Idempotent: installs only what is missing (a
# no-op where all is on PATH); needs root or passwordless apt.
set -euo pipefail
missing=()
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  missing+=(prometheus)
fi
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]} == 0)); then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  if [[ " ${missing[*]} " == *" prometheus "* ]]; then
    echo "install-system-deps.sh: promtool and prometheus are missing and this needs root and apt-get:" \
         "install Prometheus (both binaries on PATH) another way" >&2
    exit 1
  fi
  # dockerd would need root as well: the engine test says so and skips
  echo "install-system-deps.sh: ${missing[*]} missing and no root and apt-get to install them:" \
       "the Docker engine test will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

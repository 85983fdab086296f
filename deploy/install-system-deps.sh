#!/usr/bin/env bash
# System packages the test suite uses: promtool and the prometheus binary (config checks and the
# scrape integration test). Idempotent; needs root or passwordless apt.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-system-deps.sh: promtool and prometheus are missing and this needs root and apt-get:" \
       "install Prometheus (both binaries on PATH) another way" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null

#!/usr/bin/env bash
# Install what the test suite needs outside Python: redis-server, prometheus/promtool, chromium
# (Debian packages), and the separate real-vLLM venv with its tiny model (cached).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)  # redis-cli --cluster create (cluster tests)
command -v promtool >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
command -v openssl >/dev/null || need+=(openssl)  # throwaway CAs in the TLS tests (gateway, Redis)
if [ ${#need[@]} -gt 0 ]; then
  echo "[setup_test_deps] apt-get install ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The tests start their own redis-server and prometheus on free loopback ports, so services the Debian
# packages may have started (:6379, :9090) are left alone.
bash "$here/setup_vllm.sh"

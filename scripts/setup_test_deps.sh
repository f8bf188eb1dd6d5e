#!/usr/bin/env bash
# Install what the test suite needs outside Python: redis-server, prometheus/promtool, chromium
# (Debian packages), the native data plane (scripts/build_dataplane.sh: cargo and Debian's Rust crates), and the
# separate real-vLLM venv with its tiny model (cached).
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
# The native data plane's module (tests/integration/test_dataplane_wire.py). Under CI a failed build fails here;
# on a developer's machine it warns and its tests skip naming the script.
if ! bash "$here/build_dataplane.sh"; then
  case "${CI:-}" in
    1|true|TRUE|True|yes) echo "[setup_test_deps] scripts/build_dataplane.sh failed (CI)" >&2; exit 1 ;;
    *) echo "[setup_test_deps] WARNING: scripts/build_dataplane.sh failed; the native data plane's tests will skip" >&2 ;;
  esac
fi
bash "$here/setup_vllm.sh"

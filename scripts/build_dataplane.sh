#!/usr/bin/env bash
# Build Dyad's native data plane (native/dataplane, the Python module dyad_dataplane) offline from Debian's
# packaged Rust crates, and put it at orchestrator/gateway/native/dyad_dataplane.so. Installs the crates
# (librust-*-dev) and cargo with apt when they are missing. Skips the build when the .so is newer than every
# source file. PYO3_PYTHON: the Python the module is built for (default: .venv/bin/python, else python3).
# `--test` also runs the crate's Rust unit tests (cargo test; they link libpython instead of being a module).
set -euo pipefail
run_tests=""; [ "${1:-}" = "--test" ] && run_tests=1
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
crate="$repo/native/dataplane"
out="$repo/orchestrator/gateway/native/dyad_dataplane.so"
say() { echo "[build_dataplane] $*"; }

fresh=""
if [ -f "$out" ] && [ -z "$(find "$crate/src" "$crate/Cargo.toml" "$crate/Cargo.lock" -newer "$out" 2>/dev/null)" ]; then
  say "up to date: $out"
  fresh=1
  [ -n "$run_tests" ] || exit 0
fi

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
updated=""
apt_install() {
  if [ -z "$updated" ]; then
    say "apt-get update"
    $SUDO apt-get update -qq
    updated=1
  fi
  say "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}
if ! command -v cargo >/dev/null; then
  apt_install cargo
fi
if ! ls -d /usr/share/cargo/registry/{pyo3,hyper,tokio,serde_json}-[0-9]* >/dev/null 2>&1; then
  apt_install librust-pyo3-dev librust-hyper-dev librust-tokio-dev librust-serde-json-dev
fi

py="${PYO3_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then py="$repo/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
if [ -z "$fresh" ]; then
  say "cargo build --release --offline (for $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])'))"
  start=$(date +%s)
  (cd "$crate" && PYO3_PYTHON="$py" cargo build --release --offline)
  cp "$crate/target/release/libdyad_dataplane.so" "$out"
  say "built $out in $(( $(date +%s) - start )) s"
fi
if [ -n "$run_tests" ]; then
  libdir="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
  say "cargo test --offline --no-default-features --lib"
  (cd "$crate" && PYO3_PYTHON="$py" LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --offline --no-default-features --lib)
fi

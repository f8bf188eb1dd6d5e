#!/usr/bin/env bash
# Build the spike's Python module offline from Debian's packaged Rust crates (no crates.io):
# apt-get install librust-pyo3-dev librust-hyper-dev librust-tokio-dev librust-serde-json-dev, then cargo with the directory
# source in .cargo/config.toml. Needs cargo/rustc (on this machine: 1.95). Takes ~40 s on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"
if ! ls -d /usr/share/cargo/registry/{pyo3,hyper,tokio,serde_json}-[0-9]* > /dev/null 2>&1; then
  apt-get install -y -q librust-pyo3-dev librust-hyper-dev librust-tokio-dev librust-serde-json-dev
fi
PY="${PYO3_PYTHON:-$(cd ../.. && pwd)/.venv/bin/python}"
PYO3_PYTHON="$PY" cargo build --release
cp target/release/libdyad_native.so dyad_native.so
echo "built $(pwd)/dyad_native.so"

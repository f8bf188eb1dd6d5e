#!/usr/bin/env bash
# Dyad on one machine: 2 CPU vLLM engines + the gateway + Prometheus, all on 127.0.0.1.
#
#   deploy/local/run.sh        aggregated: both engines prefill and decode, kv_aware routing
#   deploy/local/run.sh pd     disaggregated: engine 0 prefills, engine 1 decodes (NIXL)
#
# Then:  curl localhost:8000/v1/chat/completions -d '{"model":"tiny","messages":[...]}'
#        open http://127.0.0.1:8000/ui (live fleet) and http://127.0.0.1:9090 (Prometheus).
# Ctrl-C stops everything.  Needs scripts/setup_vllm.sh (the vLLM venv and tiny model) and the
# Debian prometheus package.  Logs go to $DYAD_LOCAL_DIR (default /tmp/dyad-local).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
mode="${1:-agg}"
case "$mode" in agg|pd) ;; *) echo "usage: $0 [agg|pd]" >&2; exit 2 ;; esac

VENV="${DYAD_VLLM_VENV:-$HOME/.cache/dyad/vllm-venv}"
MODEL="${DYAD_MODEL_DIR:-$HOME/.cache/dyad/models/tiny-llama-512}"
DYAD="${DYAD_BIN:-$root/.venv/bin/dyad}"
DIR="${DYAD_LOCAL_DIR:-/tmp/dyad-local}"
mkdir -p "$DIR"
[ -x "$VENV/bin/python" ] || { echo "no vLLM venv at $VENV: run scripts/setup_vllm.sh" >&2; exit 1; }
[ -f "$MODEL/config.json" ] || { echo "no model at $MODEL: run scripts/setup_vllm.sh" >&2; exit 1; }
command -v prometheus >/dev/null || { echo "prometheus not installed (apt-get install prometheus)" >&2; exit 1; }

pids=()
cleanup() {
  trap - EXIT INT TERM
  echo "stopping..."
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

# NIXL on CPU: Linux must grant AMX tile state before UCX sets up its signal stack, or the
# decode engine dies with "Illegal instruction" (docs/engines.md §1, CPU setup).
mkdir -p "$DIR/amx"
cat > "$DIR/amx/sitecustomize.py" <<'PY'
import ctypes
try:
    ctypes.CDLL(None).syscall(158, 0x1023, 18)  # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
except Exception:
    pass
PY

# engine <index> <http port> <kv-events port> <replay port> <cpu core> <kv-transfer-config or "">
engine() {
  local i=$1 port=$2 ev=$3 replay=$4 core=$5 kvt=$6
  local args=(-m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny
    --host 127.0.0.1 --port "$port" --enforce-eager --kv-cache-memory-bytes 268435456
    --enable-prefix-caching --dtype bfloat16 --max-model-len 4096 --block-size 32
    --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$ev\",\"replay_endpoint\":\"tcp://127.0.0.1:$replay\",\"topic\":\"kv-events\"}")
  [ -n "$kvt" ] && args+=(--kv-transfer-config "$kvt")
  env -u VLLM_CPU_KVCACHE_SPACE VLLM_CPU_OMP_THREADS_BIND="$core" TOKENIZERS_PARALLELISM=false \
      VLLM_NIXL_SIDE_CHANNEL_PORT=$((5600 + i)) PYTHONPATH="$DIR/amx${PYTHONPATH:+:$PYTHONPATH}" \
      setsid "$VENV/bin/python" "${args[@]}" >"$DIR/engine-$i.log" 2>&1 &
  pids+=($!)
}

if [ "$mode" = pd ]; then
  engine 0 8101 5701 5702 0 '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}'
  engine 1 8102 5711 5712 1 '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu","kv_load_failure_policy":"recompute"}'
else
  engine 0 8101 5701 5702 0 ""
  engine 1 8102 5711 5712 1 ""
fi
echo "engines starting (30-60 s; logs in $DIR/engine-*.log)"
for port in 8101 8102; do
  for _ in $(seq 1 180); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "an engine exited; see $DIR" >&2; exit 1; }; done
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "engine on :$port not ready" >&2; exit 1; }
done

setsid "$DYAD" serve --config "$here/dyad-$mode.yaml" --log-level info >"$DIR/gateway.log" 2>&1 &
pids+=($!)
setsid prometheus --config.file="$here/prometheus.yml" --storage.tsdb.path="$DIR/prometheus" \
    --web.listen-address=127.0.0.1:9090 >"$DIR/prometheus.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 30); do curl -sf http://127.0.0.1:8000/ready >/dev/null && break; sleep 1; done
echo "gateway     http://127.0.0.1:8000  (fleet page: /ui, metrics: /metrics)"
echo "prometheus  http://127.0.0.1:9090"
echo "Ctrl-C to stop"
wait

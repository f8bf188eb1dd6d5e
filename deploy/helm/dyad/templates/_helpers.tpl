{{/* Names and labels. */}}
{{- define "dyad.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dyad.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dyad.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dyad.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The enabled engine pools, in a fixed order: a list of pool names. */}}
{{- define "dyad.pools" -}}
{{- $out := list -}}
{{- range $name := list "prefill" "decode" "both" -}}
{{- if (index $.Values.pools $name).enabled -}}{{- $out = append $out $name -}}{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* true when the release splits prefill and decode (both P/D pools on). */}}
{{- define "dyad.pd" -}}
{{- if and .Values.pools.prefill.enabled .Values.pools.decode.enabled -}}true{{- end -}}
{{- end -}}

{{/* Where the shared index lives: a redis URL, or "" for in-memory. */}}
{{- define "dyad.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "dyad.fullname" .) .Release.Namespace -}}
{{- else if and .Values.redis.url .Values.redis.tlsSecret -}}
{{- $q := "ssl_ca_certs=/etc/dyad-redis-tls/ca.crt" -}}
{{- if .Values.redis.tlsClientCert -}}
{{- $q = printf "%s&ssl_certfile=/etc/dyad-redis-tls/tls.crt&ssl_keyfile=/etc/dyad-redis-tls/tls.key" $q -}}
{{- end -}}
{{- printf "%s%s%s" .Values.redis.url (ternary "&" "?" (contains "?" .Values.redis.url)) $q -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* The Redis TLS Secret as a volume and its mount (gateway and planner containers). */}}
{{- define "dyad.redisTlsVolume" -}}
{{- if .Values.redis.tlsSecret }}
- name: redis-tls
  secret: {secretName: {{ .Values.redis.tlsSecret | quote }}}
{{- end }}
{{- end -}}
{{- define "dyad.redisTlsMount" -}}
{{- if .Values.redis.tlsSecret }}
- {name: redis-tls, mountPath: /etc/dyad-redis-tls, readOnly: true}
{{- end }}
{{- end -}}

{{- define "dyad.usesRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.url .Values.redis.urlSecret.name -}}true{{- end -}}
{{- end -}}

{{/* The labels that select one pool's engine pods: the StatefulSet's selector (one definition for both). */}}
{{- define "dyad.engineSelector" -}}
{{- $ := index . 0 -}}
{{ include "dyad.selector" $ }}
app.kubernetes.io/component: engine
dyad.dev/pool: {{ index . 1 }}
{{- end -}}

{{/* discovery.kubernetes: the gateways (and the planner) watch each pool's engine pods by the
     StatefulSet's own selector, in the release namespace; ports by the engine containers' names. */}}
{{- define "dyad.discovery" -}}
{{- $selectors := dict -}}
{{- range $pool := include "dyad.pools" . | fromJsonArray -}}
{{- $parts := list -}}
{{- range $k, $v := include "dyad.engineSelector" (list $ $pool) | fromYaml -}}
{{- $parts = append $parts (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- $_ := set $selectors $pool (join "," $parts) -}}
{{- end -}}
{{- $sglang := eq .Values.engine.type "sglang" -}}
{{- $k := dict "api" (dict "namespace" .Release.Namespace) "selectors" $selectors "role_label" "dyad.dev/role" "port" "http" "engine" .Values.engine.type "models" (list .Values.model.name) -}}
{{- if and (not $sglang) .Values.engine.kvEvents -}}
{{- $_ := set $k "kv_events_port" "kv-events" -}}
{{- $_ := set $k "kv_replay_port" "kv-replay" -}}
{{- end -}}
{{- if and $sglang (include "dyad.pd" .) -}}
{{- $_ := set $k "bootstrap_port" "bootstrap" -}}
{{- end -}}
{{- toYaml $k -}}
{{- end -}}

{{/* The gateway configuration (orchestrator/config.py), as YAML. */}}
{{- define "dyad.config" -}}
{{- $full := include "dyad.fullname" . -}}
{{- $ns := .Release.Namespace -}}
{{- $port := int .Values.engine.port -}}
{{- $sglang := eq .Values.engine.type "sglang" -}}
{{- $workers := list -}}
{{- if eq .Values.gateway.discovery "static" -}}
{{- range $pool := include "dyad.pools" . | fromJsonArray -}}
{{- $p := index $.Values.pools $pool -}}
{{- range $i := until (int $p.replicas) -}}
{{- $host := printf "%s-%s-%d.%s-%s.%s.svc" $full $pool $i $full $pool $ns -}}
{{- $w := dict "id" (printf "%s-%d" $pool $i) "url" (printf "http://%s:%d" $host $port) "role" $pool "engine" $.Values.engine.type "models" (list $.Values.model.name) -}}
{{- if and (not $sglang) $.Values.engine.kvEvents -}}
{{- $_ := set $w "kv_events" (dict "endpoint" (printf "tcp://%s:5557" $host) "replay_endpoint" (printf "tcp://%s:5558" $host)) -}}
{{- end -}}
{{- if and $sglang (eq $pool "prefill") -}}
{{- $_ := set $w "bootstrap_port" (int $.Values.engine.sglang.bootstrapPort) -}}
{{- end -}}
{{- $workers = append $workers $w -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $model := dict "name" .Values.model.name "block_size" (int .Values.model.blockSize) -}}
{{- if .Values.model.aliases -}}{{- $_ := set $model "aliases" .Values.model.aliases -}}{{- end -}}
{{- $cfg := dict "models" (list $model) "workers" $workers "router" (dict "policy" .Values.gateway.policy) "gateway" (dict "host" "0.0.0.0" "port" (int .Values.gateway.port)) -}}
{{- if eq .Values.gateway.discovery "kubernetes" -}}
{{- $_ := set $cfg "discovery" (dict "source" "kubernetes" "kubernetes" (include "dyad.discovery" . | fromYaml)) -}}
{{- end -}}
{{- if include "dyad.usesRedis" . -}}
{{- $_ := set $cfg "index" (dict "backend" "redis" "redis_url" (include "dyad.redisUrl" . | default "redis://set-by-env:6379/0")) -}}
{{- end -}}
{{- if include "dyad.pd" . -}}
{{- $_ := set $cfg "disagg" (dict "enabled" true "connector" "nixl") -}}
{{- end -}}
{{- if .Values.planner.enabled -}}
{{- $planner := dict "enabled" false "interval_s" .Values.planner.intervalS "ttft_target_s" .Values.planner.ttftTargetS "itl_target_s" .Values.planner.itlTargetS "max_workers" (int .Values.planner.maxWorkers) "kubernetes_namespace" $ns "kubernetes_workloads" (dict "prefill" (printf "statefulsets/%s-prefill" $full) "decode" (printf "statefulsets/%s-decode" $full)) "kubernetes_drain_settle_s" .Values.planner.drainSettleS "kubernetes_drain_timeout_s" .Values.planner.drainTimeoutS "standby_prefill" (int .Values.planner.standbyPrefill) "standby_decode" (int .Values.planner.standbyDecode) -}}
{{- if .Values.planner.prometheusUrl -}}{{- $_ := set $planner "prometheus_url" .Values.planner.prometheusUrl -}}{{- end -}}
{{- $_ := set $cfg "planner" $planner -}}
{{- end -}}
{{- $cfg = mustMergeOverwrite $cfg (deepCopy .Values.gateway.config) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Environment shared by the gateway and planner containers. */}}
{{- define "dyad.commonEnv" -}}
{{- if .Values.redis.urlSecret.name }}
- name: DYAD_INDEX__REDIS_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.redis.urlSecret.name | quote }}, key: {{ .Values.redis.urlSecret.key | quote }}}}
{{- end }}
{{- if .Values.gateway.adminTokenSecret }}
- name: DYAD_GATEWAY__ADMIN_TOKEN
  valueFrom: {secretKeyRef: {name: {{ .Values.gateway.adminTokenSecret | quote }}, key: token}}
{{- end }}
{{- end -}}

{{/* Checks that fail the render with a message naming the value. */}}
{{- define "dyad.validate" -}}
{{- $pools := include "dyad.pools" . | fromJsonArray -}}
{{- if not $pools -}}{{- fail "pools: enable at least one of prefill, decode, both" -}}{{- end -}}
{{- if and .Values.pools.prefill.enabled (not .Values.pools.decode.enabled) -}}
{{- fail "pools.prefill: a prefill pool needs a decode pool (pools.decode.enabled)" -}}
{{- end -}}
{{- if and .Values.planner.enabled (not .Values.planner.prometheusUrl) -}}
{{- fail "planner.prometheusUrl: the planner reads the gateways' latency and load from Prometheus (its own pod serves no traffic); set it, or planner.enabled=false" -}}
{{- end -}}
{{- if and .Values.planner.enabled (not (include "dyad.pd" .)) -}}
{{- fail "planner.enabled: the planner sizes prefill and decode pools; enable both, or set planner.enabled=false" -}}
{{- end -}}
{{- if and .Values.redis.enabled (or .Values.redis.url .Values.redis.urlSecret.name) -}}
{{- fail "redis: set redis.enabled=false to use an external Redis (redis.url or redis.urlSecret)" -}}
{{- end -}}
{{- if and .Values.redis.tlsSecret (not (or .Values.redis.url .Values.redis.urlSecret.name)) -}}
{{- fail "redis.tlsSecret: for an external rediss:// Redis (redis.url or redis.urlSecret)" -}}
{{- end -}}
{{- if not (has .Values.engine.type (list "vllm" "sglang")) -}}
{{- fail (printf "engine.type: %q is not vllm or sglang" .Values.engine.type) -}}
{{- end -}}
{{- if and .Values.planner.enabled (ne .Values.gateway.discovery "kubernetes") -}}
{{- fail "gateway.discovery: the planner adds and drains engine pods, which only discovery (kubernetes) sees; set gateway.discovery=kubernetes, or planner.enabled=false" -}}
{{- end -}}
{{- if and .Values.planner.enabled (lt (int .Values.planner.maxWorkers) 2) -}}
{{- fail "planner.maxWorkers: at least 2 (one prefill, one decode)" -}}
{{- end -}}
{{- end -}}

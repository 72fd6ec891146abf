{{/* ---------- names and labels ---------- */}}

{{- define "hotloop-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The RayService's name: KubeRay appends suffixes (-xxxxx-head-svc...), so stay at 40 chars. */}}
{{- define "hotloop-serve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hotloop-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hotloop-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hotloop-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "hotloop-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "hotloop-serve.serveServiceName" -}}
{{- printf "%s-serve-svc" (include "hotloop-serve.fullname" .) -}}
{{- end -}}

{{- define "hotloop-serve.sessionSecretName" -}}
{{- .Values.auth.sessionSecret.name | default (printf "%s-session" (include "hotloop-serve.fullname" .)) -}}
{{- end -}}

{{- define "hotloop-serve.sessionSecretEnv" -}}
{{- (.Values.hotloop.auth | default dict).session_secret_env | default "HOTLOOP_SESSION_SECRET" -}}
{{- end -}}

{{- define "hotloop-serve.grpcPort" -}}
{{- (.Values.hotloop.server | default dict).grpc_port | default 9000 | int -}}
{{- end -}}

{{- define "hotloop-serve.httpPort" -}}
{{- (.Values.hotloop.server | default dict).http_port | default 8000 | int -}}
{{- end -}}

{{- define "hotloop-serve.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .gpu -}}
{{- $tag = .Values.image.cudaTag | default (printf "%s-cuda" $tag) -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "hotloop-serve.tokensDir" -}}/etc/hotloop/auth{{- end -}}

{{/* The claim of sessionPersistence: the existing one, or the one the chart creates. */}}
{{- define "hotloop-serve.sessionsClaimName" -}}
{{- .Values.sessionPersistence.existingClaim | default (printf "%s-sessions" (include "hotloop-serve.fullname" .)) -}}
{{- end -}}

{{/* ---------- Kubernetes quantities ---------- */}}

{{/* bytes: a memory quantity ("2Gi", "500M", 1073741824) as an integer number of bytes. */}}
{{- define "hotloop-serve.bytes" -}}
{{- $q := toString . -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q -}}
{{- $unit := trimPrefix $num $q -}}
{{- $units := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 -}}
{{- if or (not $num) (not (hasKey $units $unit)) -}}
{{- fail (printf "memory quantity %q is not understood (use e.g. 512Mi, 4Gi, 2G)" $q) -}}
{{- end -}}
{{- mulf (float64 $num) (get $units $unit) | ceil | int64 -}}
{{- end -}}

{{/* cpus: a CPU quantity ("500m", "2", 1.5) as a number of cores. */}}
{{- define "hotloop-serve.cpus" -}}
{{- $q := toString . -}}
{{- if hasSuffix "m" $q -}}
{{- divf (float64 (trimSuffix "m" $q)) 1000.0 -}}
{{- else -}}
{{- float64 $q -}}
{{- end -}}
{{- end -}}

{{/* cpuQuantity: a number of cores as a Kubernetes quantity ("2", "1500m"). */}}
{{- define "hotloop-serve.cpuQuantity" -}}
{{- $milli := mulf (float64 .) 1000.0 | ceil | int64 -}}
{{- if eq (mod $milli 1000) 0 -}}
{{- printf "%d" (div $milli 1000) -}}
{{- else -}}
{{- printf "%dm" $milli -}}
{{- end -}}
{{- end -}}

{{/* ---------- models and worker groups ---------- */}}

{{/* A model's needs as JSON: {"cpu": cores, "gpu": gpus, "mem": bytes or 0}. */}}
{{- define "hotloop-serve.modelNeeds" -}}
{{- $r := .resources | default dict -}}
{{- $cpu := 1.0 -}}
{{- if hasKey $r "num_cpus" -}}{{- $cpu = float64 $r.num_cpus -}}{{- end -}}
{{- $gpu := 0.0 -}}
{{- if hasKey $r "num_gpus" -}}{{- $gpu = float64 $r.num_gpus -}}{{- end -}}
{{- $mem := 0 -}}
{{- if $r.memory_bytes -}}{{- $mem = int64 $r.memory_bytes -}}{{- end -}}
{{- dict "cpu" $cpu "gpu" $gpu "mem" $mem | toJson -}}
{{- end -}}

{{/*
The models a group hosts: a group with GPUs hosts the models that need GPUs (all models when
none does); a group without GPUs hosts the models that need none.
*/}}
{{- define "hotloop-serve.groupModels" -}}
{{- $root := .root -}}
{{- $gpus := int (.group.gpus | default 0) -}}
{{- $gpuModels := list -}}
{{- $cpuModels := list -}}
{{- range $m := $root.Values.hotloop.models -}}
{{- $n := include "hotloop-serve.modelNeeds" $m | fromJson -}}
{{- if gt (float64 $n.gpu) 0.0 -}}
{{- $gpuModels = append $gpuModels $n -}}
{{- else -}}
{{- $cpuModels = append $cpuModels $n -}}
{{- end -}}
{{- end -}}
{{- if gt $gpus 0 -}}
{{- if $gpuModels -}}{{- toJson $gpuModels -}}{{- else -}}{{- toJson $cpuModels -}}{{- end -}}
{{- else -}}
{{- toJson $cpuModels -}}
{{- end -}}
{{- end -}}

{{/*
The cores a sized worker group's replicas reserve from Ray: replicasPerPod x the largest
num_cpus of its models, at least 1.
*/}}
{{- define "hotloop-serve.groupCores" -}}
{{- $cpu := 0.0 -}}
{{- range $n := include "hotloop-serve.groupModels" . | fromJsonArray -}}
{{- $cpu = maxf $cpu (float64 $n.cpu) -}}
{{- end -}}
{{- maxf 1.0 (mulf (int (.group.replicasPerPod | default 1)) $cpu) -}}
{{- end -}}

{{/*
Container resources of a worker group: the group's own `resources`, or sized from its models
(see `sizing` in values.yaml). nvidia.com/gpu comes from `gpus` either way.
*/}}
{{- define "hotloop-serve.groupResources" -}}
{{- $root := .root -}}
{{- $g := .group -}}
{{- $gpus := int ($g.gpus | default 0) -}}
{{- $res := dict -}}
{{- if $g.resources -}}
{{- $res = deepCopy $g.resources -}}
{{- $req := $res.requests | default dict -}}
{{- if not (and $req.cpu $req.memory) -}}
{{- fail (printf "workerGroups.%s.resources: set requests.cpu and requests.memory, or leave resources empty to size the pods from the models" .name) -}}
{{- end -}}
{{- else -}}
{{- $models := include "hotloop-serve.groupModels" . | fromJsonArray -}}
{{- $slots := int ($g.replicasPerPod | default 1) -}}
{{- $mem := 0 -}}
{{- range $n := $models -}}
{{- $mem = max $mem (int64 $n.mem) -}}
{{- end -}}
{{- if eq (int64 $mem) 0 -}}
{{- $mem = include "hotloop-serve.bytes" $root.Values.sizing.replicaMemory | int64 -}}
{{- end -}}
{{- $overhead := include "hotloop-serve.bytes" $root.Values.sizing.podOverhead | int64 -}}
{{- $podBytes := divf (add (mul $slots $mem) $overhead) 0.7 -}}
{{- $mi := divf $podBytes 1048576.0 | ceil | int64 -}}
{{- $cores := include "hotloop-serve.groupCores" . | float64 -}}
{{- $podCores := addf $cores (include "hotloop-serve.cpus" ($root.Values.sizing.podCpuOverhead | default 0) | float64) -}}
{{- $q := dict "cpu" (include "hotloop-serve.cpuQuantity" $podCores) "memory" (printf "%dMi" $mi) -}}
{{- $_ := set $res "requests" (deepCopy $q) -}}
{{- $_ := set $res "limits" (deepCopy $q) -}}
{{- end -}}
{{- if gt $gpus 0 -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" $gpus -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toJson $res -}}
{{- end -}}

{{/* What a pod offers to Ray: {"cpu": cores, "gpu": n, "mem": bytes Ray may reserve}. */}}
{{- define "hotloop-serve.podCapacity" -}}
{{- $res := .resources -}}
{{- $req := $res.requests | default dict -}}
{{- $lim := $res.limits | default dict -}}
{{- $cpu := include "hotloop-serve.cpus" ($lim.cpu | default $req.cpu | default 0) | float64 -}}
{{- with .params -}}{{- if hasKey . "num-cpus" -}}
{{- $cpu = float64 (get . "num-cpus") -}}
{{- end -}}{{- end -}}
{{- $memQ := $lim.memory | default $req.memory | default 0 -}}
{{- $mem := include "hotloop-serve.bytes" $memQ | float64 -}}
{{- $gpu := get $lim "nvidia.com/gpu" | default 0 | float64 -}}
{{- dict "cpu" $cpu "gpu" $gpu "mem" (mulf $mem 0.7 | int64) | toJson -}}
{{- end -}}

{{/* The enabled worker groups as a JSON list of {name, group, resources}, sorted by name. */}}
{{- define "hotloop-serve.workerGroups" -}}
{{- $root := . -}}
{{- $out := list -}}
{{- range $name := keys .Values.workerGroups | sortAlpha -}}
{{- $g := get $root.Values.workerGroups $name -}}
{{- if ne (toString $g.enabled) "false" -}}
{{- $res := include "hotloop-serve.groupResources" (dict "root" $root "group" $g "name" $name) | fromJson -}}
{{- $params := deepCopy ($g.rayStartParams | default dict) -}}
{{- if and (not $g.resources) (not (hasKey $params "num-cpus")) -}}
{{- /* The pod's CPU includes sizing.podCpuOverhead for Ray's own processes: Ray schedules
replicas on the models' cores only (what KubeRay would derive from the limit before it). */ -}}
{{- $cores := include "hotloop-serve.groupCores" (dict "root" $root "group" $g "name" $name) | float64 -}}
{{- $_ := set $params "num-cpus" (ceil $cores | int64 | toString) -}}
{{- end -}}
{{- $out = append $out (dict "name" $name "group" $g "resources" $res "params" $params) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* ---------- checks a schema cannot express ---------- */}}

{{- define "hotloop-serve.validate" -}}
{{- $root := . -}}
{{- $names := list -}}
{{- $src := .Values.modelSource -}}
{{- $urlFiles := list -}}
{{- range $f := $src.url.files -}}{{- $urlFiles = append $urlFiles $f.filename -}}{{- end -}}
{{- if eq (include "hotloop-serve.grpcPort" .) (include "hotloop-serve.httpPort" .) -}}
{{- fail (printf "hotloop.server.grpc_port and hotloop.server.http_port are both %s" (include "hotloop-serve.grpcPort" .)) -}}
{{- end -}}
{{- range $i, $m := .Values.hotloop.models -}}
{{- $name := $m.name | default "gemma-3-270m" -}}
{{- if has $name $names -}}
{{- fail (printf "hotloop.models[%d].name: model name %q is used twice (each model is a Serve application named after it)" $i $name) -}}
{{- end -}}
{{- $names = append $names $name -}}
{{- $a := $m.autoscaling -}}
{{- if $a -}}
{{- $min := int (hasKey $a "min_replicas" | ternary $a.min_replicas 1) -}}
{{- $max := int (hasKey $a "max_replicas" | ternary $a.max_replicas 2) -}}
{{- if gt $min $max -}}
{{- fail (printf "hotloop.models[%d].autoscaling (model %s): min_replicas (%d) > max_replicas (%d)" $i $name $min $max) -}}
{{- end -}}
{{- end -}}
{{- $e := $m.engine | default dict -}}
{{- $ctx := int ($e.context_tokens | default 16384) -}}
{{- $sctx := int ($e.session_context_tokens | default 8192) -}}
{{- $hot := int ($e.hot_sessions | default 8) -}}
{{- $batch := int ($e.batch_tokens | default 512) -}}
{{- if gt $sctx $ctx -}}
{{- fail (printf "hotloop.models[%d].engine (model %s): session_context_tokens (%d) > context_tokens (%d)" $i $name $sctx $ctx) -}}
{{- end -}}
{{- if lt (int ($e.max_sessions | default 256)) $hot -}}
{{- fail (printf "hotloop.models[%d].engine (model %s): max_sessions (%d) < hot_sessions (%d)" $i $name (int ($e.max_sessions | default 256)) $hot) -}}
{{- end -}}
{{- if lt $batch $hot -}}
{{- fail (printf "hotloop.models[%d].engine (model %s): batch_tokens (%d) < hot_sessions (%d)" $i $name $batch $hot) -}}
{{- end -}}
{{- if and (eq ($e.kind | default "llama") "synthetic") (not $root.Values.allowSyntheticEngine) -}}
{{- fail (printf "hotloop.models[%d].engine.kind (model %s) is synthetic: a load generator that answers every prompt with filler text, not the model; set allowSyntheticEngine: true only to benchmark the serving layer" $i $name) -}}
{{- end -}}
{{- if gt (int ($e.prefill_chunk | default 128)) $batch -}}
{{- fail (printf "hotloop.models[%d].engine (model %s): prefill_chunk (%d) > batch_tokens (%d)" $i $name (int ($e.prefill_chunk | default 128)) $batch) -}}
{{- end -}}
{{- $path := $m.path | default "" -}}
{{- if and (ne $src.type "embedded") (not $path) -}}
{{- fail (printf "hotloop.models[%d].path (model %s) is unset, which means the embedded model, while modelSource.type is %s: name a file on the model volume, or set path: embedded:gemma-3-270m" $i $name $src.type) -}}
{{- end -}}
{{- if and $path (not (hasPrefix "embedded:" $path)) (not (hasPrefix "/" $path)) -}}
{{- if eq $src.type "embedded" -}}
{{- fail (printf "hotloop.models[%d].path (model %s) %q is a file on the model volume, but modelSource.type is embedded: set modelSource (pvc, image or url)" $i $name $path) -}}
{{- end -}}
{{- if and (eq $src.type "url") (not (has $path $urlFiles)) -}}
{{- fail (printf "hotloop.models[%d].path (model %s) %q is not one of modelSource.url.files[].filename %v" $i $name $path $urlFiles) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.auth.tokensSecret.name (.Values.hotloop.auth | default dict).tokens_file -}}
{{- fail "set either auth.tokensSecret.name (the chart mounts it and fills hotloop.auth.tokens_file) or hotloop.auth.tokens_file, not both" -}}
{{- end -}}
{{- $sp := .Values.sessionPersistence -}}
{{- if $sp.enabled -}}
{{- $spMount := trimSuffix "/" $sp.mountPath -}}
{{- if and (ne $src.type "embedded") (eq $spMount (trimSuffix "/" $src.mountPath)) -}}
{{- fail (printf "sessionPersistence.mountPath %q is also modelSource.mountPath: give the sessions their own directory" $sp.mountPath) -}}
{{- end -}}
{{- if and .Values.auth.tokensSecret.name (eq $spMount (include "hotloop-serve.tokensDir" .)) -}}
{{- fail (printf "sessionPersistence.mountPath %q is where the auth tokens are mounted" $sp.mountPath) -}}
{{- end -}}
{{- if not $sp.existingClaim -}}
{{- $budget := 0 -}}
{{- range $m := .Values.hotloop.models -}}
{{- $e := $m.engine | default dict -}}
{{- $budget = add $budget (hasKey $e "persist_bytes" | ternary $e.persist_bytes 8589934592 | int64) -}}
{{- end -}}
{{- $claim := include "hotloop-serve.bytes" $sp.size | int64 -}}
{{- if lt $claim (int64 $budget) -}}
{{- fail (printf "sessionPersistence.size %v (%d bytes) is less than the models' disk budgets (the sum of engine.persist_bytes, 8 GiB each by default: %d bytes): raise the size or lower persist_bytes" $sp.size $claim (int64 $budget)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* every model must fit one pod that runs replicas */ -}}
{{- $pods := list -}}
{{- range $w := include "hotloop-serve.workerGroups" . | fromJsonArray -}}
{{- $pods = append $pods (dict "name" (printf "workerGroups.%s" $w.name) "cap" (include "hotloop-serve.podCapacity" (dict "resources" $w.resources "params" $w.params) | fromJson)) -}}
{{- end -}}
{{- if .Values.head.runReplicas -}}
{{- $pods = append $pods (dict "name" "head" "cap" (include "hotloop-serve.podCapacity" (dict "resources" .Values.head.resources) | fromJson)) -}}
{{- end -}}
{{- if not $pods -}}
{{- fail "no pod runs model replicas: enable a worker group or set head.runReplicas" -}}
{{- end -}}
{{- range $i, $m := .Values.hotloop.models -}}
{{- $n := include "hotloop-serve.modelNeeds" $m | fromJson -}}
{{- $fits := false -}}
{{- range $p := $pods -}}
{{- $c := $p.cap -}}
{{- if and (le (float64 $n.cpu) (float64 $c.cpu)) (le (float64 $n.gpu) (float64 $c.gpu)) (le (float64 $n.mem) (float64 $c.mem)) -}}
{{- $fits = true -}}
{{- end -}}
{{- end -}}
{{- if not $fits -}}
{{- $sizes := list -}}
{{- range $p := $pods -}}
{{- $sizes = append $sizes (printf "%s: num_cpus %v, num_gpus %v, memory_bytes %v" $p.name $p.cap.cpu $p.cap.gpu (int64 $p.cap.mem)) -}}
{{- end -}}
{{- fail (printf "hotloop.models[%d].resources (model %s: num_cpus %v, num_gpus %v, memory_bytes %v) fits no pod that runs replicas (%s; Ray may reserve about 70%% of a pod's memory): raise that group's resources or gpus, or lower the model's" $i ($m.name | default "gemma-3-270m") $n.cpu $n.gpu (int64 $n.mem) (join "; " $sizes)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* ---------- the hotloop config document and serveConfigV2 ---------- */}}

{{/* The hotloop config document with the pod-specific fields filled in, as YAML. */}}
{{- define "hotloop-serve.config" -}}
{{- $root := . -}}
{{- $cfg := deepCopy .Values.hotloop -}}
{{- $server := $cfg.server | default dict -}}
{{- $_ := set $server "host" "0.0.0.0" -}}
{{- $_ := set $server "grpc_port" (include "hotloop-serve.grpcPort" . | int) -}}
{{- $_ := set $server "http_port" (include "hotloop-serve.httpPort" . | int) -}}
{{- $_ := set $cfg "server" $server -}}
{{- $auth := $cfg.auth | default dict -}}
{{- if .Values.auth.tokensSecret.name -}}
{{- $_ := set $auth "tokens_file" (printf "%s/%s" (include "hotloop-serve.tokensDir" .) .Values.auth.tokensSecret.key) -}}
{{- end -}}
{{- $_ := set $auth "session_secret_env" (include "hotloop-serve.sessionSecretEnv" .) -}}
{{- $_ := set $cfg "auth" $auth -}}
{{- $mount := trimSuffix "/" .Values.modelSource.mountPath -}}
{{- $sp := .Values.sessionPersistence -}}
{{- $models := list -}}
{{- range $m := $cfg.models -}}
{{- $m := deepCopy $m -}}
{{- $path := $m.path | default "" -}}
{{- if and $path (not (hasPrefix "embedded:" $path)) (not (hasPrefix "/" $path)) -}}
{{- $_ := set $m "path" (printf "%s/%s" $mount $path) -}}
{{- end -}}
{{- if $sp.enabled -}}
{{- /* the disk tier of session caches on the mounted claim, one directory per model */ -}}
{{- $e := $m.engine | default dict -}}
{{- $dir := $e.persist_dir | default ($m.name | default "gemma-3-270m") -}}
{{- if not (hasPrefix "/" $dir) -}}
{{- $dir = printf "%s/%s" (trimSuffix "/" $sp.mountPath) $dir -}}
{{- end -}}
{{- $_ := set $e "persist_dir" $dir -}}
{{- $_ := set $m "engine" $e -}}
{{- end -}}
{{- $e := $m.engine | default dict -}}
{{- if not (hasKey $e "threads") -}}
{{- /* llama.cpp decodes with the replica's num_cpus threads (a pod may hold several replicas;
       each would otherwise take every core of the pod's CPU limit: engine/cpus.py) */ -}}
{{- $ncpu := 1.0 -}}
{{- if hasKey ($m.resources | default dict) "num_cpus" -}}{{- $ncpu = float64 $m.resources.num_cpus -}}{{- end -}}
{{- $_ := set $e "threads" (max 1 (floor $ncpu | int)) -}}
{{- $_ := set $m "engine" $e -}}
{{- end -}}
{{- $models = append $models $m -}}
{{- end -}}
{{- $_ := set $cfg "models" $models -}}
{{- toYaml $cfg -}}
{{- end -}}

{{- define "hotloop-serve.serveConfig" -}}
{{- $cfg := include "hotloop-serve.config" . | fromYaml -}}
{{- $timeout := ($cfg.server).request_timeout_s -}}
{{- $http := dict "host" "0.0.0.0" "port" (include "hotloop-serve.httpPort" . | int) -}}
{{- $grpc := dict "port" (include "hotloop-serve.grpcPort" . | int) "grpc_servicer_functions" (list
    "hotloop.v1.session_pb2_grpc.add_SessionServiceServicer_to_server"
    "hotloop.v1.model_pb2_grpc.add_ModelServiceServicer_to_server"
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server") -}}
{{- if $timeout -}}
{{- /* as the CLI does (serve/runner.py): on the gRPC proxy */ -}}
{{- $_ := set $grpc "request_timeout_s" $timeout -}}
{{- end -}}
{{- $apps := list -}}
{{- range $m := $cfg.models -}}
{{- $name := $m.name | default "gemma-3-270m" -}}
{{- $apps = append $apps (dict
    "name" $name
    "route_prefix" (printf "/%s" $name)
    "import_path" "hotloop_serve.serve.app:build_app"
    "args" (dict "model" $name "config" $cfg)) -}}
{{- end -}}
{{- toYaml (dict "http_options" $http "grpc_options" $grpc "applications" $apps) -}}
{{- end -}}

{{/* ---------- pod pieces shared by the head and the workers ---------- */}}

{{- define "hotloop-serve.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: {{ include "hotloop-serve.sessionSecretEnv" . }}
  valueFrom:
    secretKeyRef:
      name: {{ include "hotloop-serve.sessionSecretName" . }}
      key: {{ .Values.auth.sessionSecret.key }}
{{- /* Ray's gRPC proxy reads its message limit once, at start: the largest request any model
accepts (limits.max_request_bytes, 4 MiB by default) plus 64 KiB, so the replica names the limit
(hotloop_serve/serve/app.py proxy_message_limit). */}}
{{- $largest := 4194304 }}
{{- range (.Values.hotloop.models | default list) }}
{{- $limit := (dig "limits" "max_request_bytes" 4194304 .) | int }}
{{- if gt $limit $largest }}{{ $largest = $limit }}{{ end }}
{{- end }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ add $largest 65536 | quote }}
{{- /* The same plus the envelope a request travels in from proxy to replica over Ray's gRPC
transport (app.py replica_message_limit). */}}
- name: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
  value: {{ add $largest 131072 | quote }}
{{- /* How Ray runs, as `hotloop-serve start` sets it: slower Serve control and metrics loops,
workers (the replicas) at nice 0, proxies reaching replicas over gRPC (hotloop_serve/serve/runner.py RAY_SERVE_ENV says why;
bench/stack.py measures it). */}}
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "0.5"
- name: RAY_SERVE_METRICS_EXPORT_INTERVAL_MS
  value: "1000"
- name: RAY_worker_niceness
  value: "0"
- name: RAY_SERVE_PROXY_USE_GRPC
  value: "1"
{{- with .Values.otel }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
{{- if not (kindIs "invalid" .insecure) }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .insecure | toString | quote }}
{{- end }}
{{- if .headersSecret.name }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ .headersSecret.name }}
      key: {{ .headersSecret.key }}
{{- end }}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ .serviceName | default (include "hotloop-serve.fullname" $) | quote }}
{{- $attrs := list "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" "k8s.node.name=$(NODE_NAME)" }}
{{- range $k := keys .resourceAttributes | sortAlpha }}
{{- $attrs = append $attrs (printf "%s=%s" $k (get $.Values.otel.resourceAttributes $k)) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- end }}
{{- if .Values.metrics.prometheus.enabled }}
- name: OTEL_METRICS_EXPORTER
  value: prometheus
- name: OTEL_EXPORTER_PROMETHEUS_PORT
  value: {{ .Values.metrics.prometheus.port | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes; .models: whether this pod runs replicas (and so needs the model volume). */}}
{{- define "hotloop-serve.volumes" -}}
{{- $root := .root -}}
{{- $src := $root.Values.modelSource -}}
{{- if $root.Values.auth.tokensSecret.name }}
- name: hotloop-tokens
  secret:
    secretName: {{ $root.Values.auth.tokensSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ $root.Values.auth.tokensSecret.key }}
        path: {{ $root.Values.auth.tokensSecret.key }}
{{- end }}
{{- if and .models $root.Values.sessionPersistence.enabled }}
- name: hotloop-sessions
  persistentVolumeClaim:
    claimName: {{ include "hotloop-serve.sessionsClaimName" $root }}
{{- end }}
{{- if and .models (ne $src.type "embedded") }}
{{- if eq $src.type "pvc" }}
- name: hotloop-models
  persistentVolumeClaim:
    claimName: {{ $src.pvc.claimName }}
    readOnly: {{ $src.pvc.readOnly }}
{{- else if and (eq $src.type "image") (eq $src.image.mode "volume") }}
- name: hotloop-models
  image:
    reference: {{ printf "%s:%s" $src.image.repository $src.image.tag | quote }}
    pullPolicy: {{ $src.image.pullPolicy }}
{{- else if and (eq $src.type "url") $src.url.claimName }}
- name: hotloop-models
  persistentVolumeClaim:
    claimName: {{ $src.url.claimName }}
{{- else }}
{{- $limit := ternary $src.url.sizeLimit $src.image.sizeLimit (eq $src.type "url") }}
- name: hotloop-models
  emptyDir:
    {{- if $limit }}
    sizeLimit: {{ $limit }}
    {{- else }} {}
    {{- end }}
{{- end }}
{{- if eq $src.type "url" }}
- name: hotloop-fetch
  configMap:
    name: {{ include "hotloop-serve.fullname" $root }}-fetch
    defaultMode: 0444
{{- end }}
{{- end }}
{{- end -}}

{{- define "hotloop-serve.volumeMounts" -}}
{{- $root := .root -}}
{{- $src := $root.Values.modelSource -}}
{{- if $root.Values.auth.tokensSecret.name }}
- name: hotloop-tokens
  mountPath: {{ include "hotloop-serve.tokensDir" $root }}
  readOnly: true
{{- end }}
{{- if and .models $root.Values.sessionPersistence.enabled }}
- name: hotloop-sessions
  mountPath: {{ $root.Values.sessionPersistence.mountPath }}
  {{- with $root.Values.sessionPersistence.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- if and .models (ne $src.type "embedded") }}
- name: hotloop-models
  mountPath: {{ $src.mountPath }}
  {{- if eq $src.type "pvc" }}
  readOnly: {{ $src.pvc.readOnly }}
  {{- with $src.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
  {{- else }}
  readOnly: true
  {{- if and (eq $src.type "image") (eq $src.image.mode "volume") (ne (trimAll "/" $src.image.path) "") }}
  subPath: {{ trimAll "/" $src.image.path }}
  {{- end }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Init containers that put the model files on the volume (image copy / url download). */}}
{{- define "hotloop-serve.initContainers" -}}
{{- $root := .root -}}
{{- $src := $root.Values.modelSource -}}
{{- if and .models (eq $src.type "image") (eq $src.image.mode "copy") }}
- name: copy-model
  image: {{ printf "%s:%s" $src.image.repository $src.image.tag | quote }}
  imagePullPolicy: {{ $src.image.pullPolicy }}
  command: ["sh", "-c", "cp -a \"$SRC\"/. /hotloop-models/ && ls -l /hotloop-models"]
  env:
    - name: SRC
      value: {{ $src.image.path | quote }}
  volumeMounts:
    - name: hotloop-models
      mountPath: /hotloop-models
  {{- with $root.Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- else if and .models (eq $src.type "url") }}
- name: fetch-model
  image: {{ $src.url.fetchImage | default (include "hotloop-serve.image" (dict "Values" $root.Values "Chart" $root.Chart "gpu" false)) | quote }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["python", "/hotloop-fetch/fetch_model.py"]
  env:
    - name: HOTLOOP_MODEL_DIR
      value: /hotloop-models
    - name: HOTLOOP_MODEL_FILES
      value: {{ toJson $src.url.files | quote }}
    {{- if $src.url.bearerTokenSecret.name }}
    - name: HOTLOOP_FETCH_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $src.url.bearerTokenSecret.name }}
          key: {{ $src.url.bearerTokenSecret.key }}
    {{- end }}
  volumeMounts:
    - name: hotloop-models
      mountPath: /hotloop-models
    - name: hotloop-fetch
      mountPath: /hotloop-fetch
      readOnly: true
  {{- with $root.Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "hotloop-serve.ports" -}}
- name: serve
  containerPort: {{ include "hotloop-serve.httpPort" . }}
  protocol: TCP
- name: serve-grpc
  containerPort: {{ include "hotloop-serve.grpcPort" . }}
  protocol: TCP
{{- end -}}

{{/* The Prometheus endpoint of a pod that runs model replicas (metrics.prometheus), scraped by the PodMonitor. */}}
{{- define "hotloop-serve.metricsPort" -}}
{{- if .Values.metrics.prometheus.enabled -}}
- name: hotloop-metrics
  containerPort: {{ .Values.metrics.prometheus.port }}
  protocol: TCP
{{- end -}}
{{- end -}}

{{/* pod-level fields common to every Ray pod: .root, .spec (nodeSelector, tolerations) */}}
{{- define "hotloop-serve.podSpecCommon" -}}
{{- $root := .root -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with $root.Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

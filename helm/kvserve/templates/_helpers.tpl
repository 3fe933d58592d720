{{/* Names and labels. */}}
{{- define "kvserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvserve.labels" -}}
{{ include "kvserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvserve.rayTokenSecret" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-token" (include "kvserve.fullname" .)) -}}
{{- end -}}

{{/* Where the OpenAI endpoint's API keys come from: "existing" (apiKeys.existingSecret), "keys"
(apiKeys.keys, into the chart's Secret), "generated" (neither: the chart makes one random key into
its Secret, kept across upgrades) or "open" (neither, and apiKeys.allowUnauthenticated: true). */}}
{{- define "kvserve.apiKeysMode" -}}
{{- if .Values.apiKeys.existingSecret -}}existing
{{- else if .Values.apiKeys.keys -}}keys
{{- else if .Values.apiKeys.allowUnauthenticated -}}open
{{- else -}}generated
{{- end -}}
{{- end -}}

{{- define "kvserve.apiKeysEnabled" -}}
{{- if ne (include "kvserve.apiKeysMode" .) "open" -}}true{{- end -}}
{{- end -}}

{{- define "kvserve.adminKeysSecret" -}}
{{- if .Values.adminApiKeys.existingSecret -}}{{ .Values.adminApiKeys.existingSecret }}
{{- else if .Values.adminApiKeys.keys -}}{{ printf "%s-admin-keys" (include "kvserve.fullname" .) }}
{{- end -}}
{{- end -}}

{{- define "kvserve.redisSecret" -}}
{{- if .Values.redis.existingSecret -}}{{ .Values.redis.existingSecret }}
{{- else if .Values.redis.url -}}{{ printf "%s-redis" (include "kvserve.fullname" .) }}
{{- end -}}
{{- end -}}

{{- define "kvserve.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "kvserve.fullname" .)) -}}
{{- end -}}

{{/* The models as the application gets them: modelDefaults under each entry, and, where the
entry sets no cost_per_replica_hour, one priced from `cost`: a GPU replica (device cuda) costs
perGpuHour per rank (tensor_parallel_size x pipeline_parallel_size), any other perCpuHour per
logical CPU it asks for (replica_cpus, default 1, plus worker_cpus, default 1, per rank when it
has several). */}}
{{- define "kvserve.models" -}}
{{- $models := list -}}
{{- $cost := .Values.cost | default dict -}}
{{- range .Values.models -}}
{{- $m := mergeOverwrite (deepCopy $.Values.modelDefaults) (deepCopy .) -}}
{{- if not (hasKey $m "cost_per_replica_hour") -}}
{{- $ranks := mul (int ($m.tensor_parallel_size | default 1)) (int ($m.pipeline_parallel_size | default 1)) -}}
{{- if and (eq (toString ($m.device | default "auto")) "cuda") (kindIs "float64" $cost.perGpuHour) -}}
{{- $_ := set $m "cost_per_replica_hour" (mulf $cost.perGpuHour $ranks) -}}
{{- else if and (ne (toString ($m.device | default "auto")) "cuda") (kindIs "float64" $cost.perCpuHour) -}}
{{- $cpus := float64 (hasKey $m "replica_cpus" | ternary $m.replica_cpus 1.0) -}}
{{- if gt $ranks 1 -}}
{{- $cpus = addf $cpus (mulf (float64 (hasKey $m "worker_cpus" | ternary $m.worker_cpus 1.0)) $ranks) -}}
{{- end -}}
{{- $_ := set $m "cost_per_replica_hour" (mulf $cost.perCpuHour $cpus) -}}
{{- end -}}
{{- end -}}
{{- $models = append $models $m -}}
{{- end -}}
{{- toJson $models -}}
{{- end -}}

{{/* CPUs of a worker group as Ray sees them: rayStartParams num-cpus, else the container's CPU
limit, else its request ("500m" = 0.5); -1 when none is given. */}}
{{- define "kvserve.groupCpus" -}}
{{- $c := "" -}}
{{- $res := .resources | default dict -}}
{{- if hasKey (.rayStartParams | default dict) "num-cpus" -}}
{{- $c = toString (index .rayStartParams "num-cpus") -}}
{{- else if hasKey ($res.limits | default dict) "cpu" -}}
{{- $c = toString $res.limits.cpu -}}
{{- else if hasKey ($res.requests | default dict) "cpu" -}}
{{- $c = toString $res.requests.cpu -}}
{{- end -}}
{{- if eq $c "" -}}-1{{- else if hasSuffix "m" $c -}}{{- divf (float64 (trimSuffix "m" $c)) 1000 -}}{{- else -}}{{- float64 $c -}}{{- end -}}
{{- end -}}

{{/* Refuse models that no worker group can hold. A replica of a model on `cuda` asks Ray for
tensor_parallel_size * pipeline_parallel_size bundles of one GPU each, STRICT_PACKed onto one node
(the default placement_group_strategy; with another strategy only one stage's tensor_parallel_size
GPUs must share a pod), plus CPUs: replica_cpus + ranks * worker_cpus (ModelArgs' defaults: 1 and 1;
kvserve/deployments/app.py llm_deployment_options). Only groups that may have pods (maxReplicas > 0) count. */}}
{{- define "kvserve.checkModels" -}}
{{- if not .Values.models -}}
{{- fail "models: give at least one model" -}}
{{- end -}}
{{- if hasKey .Values.app.args "models" -}}
{{- fail "app.args.models: put models under `models`, not app.args" -}}
{{- end -}}
{{- if or (hasKey .Values.app.args "api_keys") (hasKey .Values.app.args "api_keys_file") -}}
{{- fail "app.args.api_keys / api_keys_file: give API keys through `apiKeys` (a Secret), never in the RayService spec" -}}
{{- end -}}
{{- if hasKey .Values.app.args "admin_api_keys" -}}
{{- fail "app.args.admin_api_keys: give admin keys through `adminApiKeys` (a Secret), never in the RayService spec" -}}
{{- end -}}
{{- if hasKey .Values.app.args "redis_url" -}}
{{- fail "app.args.redis_url: give the Redis URL (it holds the password) through `redis` (a Secret), never in the RayService spec" -}}
{{- end -}}
{{- $groups := .Values.workerGroups -}}
{{- $maxGpus := 0 -}}
{{- $largest := "" -}}
{{- range $groups -}}
{{- if and (gt (int .maxReplicas) 0) (gt (int .gpus) $maxGpus) -}}
{{- $maxGpus = int .gpus -}}
{{- $largest = .name -}}
{{- end -}}
{{- end -}}
{{- range $i, $m := (include "kvserve.models" . | fromJsonArray) -}}
{{- $name := $m.served_model_name | default $m.model | default "the default model" -}}
{{- if eq (toString $m.device) "cuda" -}}
{{- $tp := int ($m.tensor_parallel_size | default 1) -}}
{{- if eq (toString ($m.placement_group_strategy | default "STRICT_PACK")) "STRICT_PACK" -}}
{{- $tp = mul $tp (int ($m.pipeline_parallel_size | default 1)) -}}
{{- end -}}
{{- $cpus := addf ($m.replica_cpus | default 1.0) (mulf $tp ($m.worker_cpus | default 1.0)) -}}
{{- if eq $maxGpus 0 -}}
{{- fail (printf "models[%d] (%s): a GPU replica (device cuda) fits no worker group: no group has gpus > 0 and maxReplicas > 0" $i $name) -}}
{{- end -}}
{{- if gt $tp $maxGpus -}}
{{- fail (printf "models[%d] (%s): %d ranks per node (tensor_parallel_size, times pipeline_parallel_size with STRICT_PACK) are more than any worker group's GPUs (the largest, %q, has %d)" $i $name $tp $largest $maxGpus) -}}
{{- end -}}
{{- $fits := false -}}
{{- range $groups -}}
{{- $gc := float64 (include "kvserve.groupCpus" .) -}}
{{- if and (gt (int .maxReplicas) 0) (ge (int .gpus) $tp) (or (lt $gc 0.0) (ge $gc $cpus)) -}}
{{- $fits = true -}}
{{- end -}}
{{- end -}}
{{- if not $fits -}}
{{- fail (printf "models[%d] (%s): a GPU replica (%d ranks on one pod: %d GPUs and %g CPUs) fits no worker group" $i $name $tp $tp $cpus) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* serveConfigV2: one application (kvserve.deployments.app:build_app) whose args are app.args, the
models and the mounted API key file. */}}
{{- define "kvserve.serveConfig" -}}
{{- $args := deepCopy .Values.app.args -}}
{{- $_ := set $args "models" (include "kvserve.models" . | fromJsonArray) -}}
{{- if include "kvserve.apiKeysEnabled" . -}}
{{- $_ := set $args "api_keys_file" (printf "%s/%s" .Values.apiKeys.mountPath .Values.apiKeys.secretKey) -}}
{{- end -}}
{{- $app := dict "name" .Values.app.name "route_prefix" .Values.app.routePrefix "import_path" "kvserve.deployments.app:build_app" "args" $args -}}
{{- $cfg := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" (list $app) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Volumes and mounts every Ray container gets: the API key file, the model cache, /tmp (Ray's
session files; the root file system is read-only). */}}
{{- define "kvserve.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
- name: model-cache
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelCache.sizeLimit }}
{{- end }}
{{- if include "kvserve.apiKeysEnabled" . }}
- name: api-keys
  secret:
    secretName: {{ include "kvserve.apiKeysSecret" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.apiKeys.secretKey }}
        path: {{ .Values.apiKeys.secretKey }}
{{- end }}
{{- end -}}

{{- define "kvserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
{{- if include "kvserve.apiKeysEnabled" . }}
- name: api-keys
  mountPath: {{ .Values.apiKeys.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kvserve.env" -}}
- name: HF_HOME
  value: {{ .Values.modelCache.mountPath }}
{{- /* as `kvserve serve` starts its Ray (cluster.LOCAL_RAY_ENV): workers at niceness 0, Serve's
     control loop every 0.5 s and metrics flushes every 1 s, for an idle app that costs little */}}
- name: RAY_worker_niceness
  value: "0"
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "0.5"
- name: RAY_SERVE_METRICS_EXPORT_INTERVAL_MS
  value: "1000"
{{- /* Serve's proxy (uvicorn) believes no X-Forwarded-For itself: the gateway's forwarded_allow_ips decides */}}
- name: FORWARDED_ALLOW_IPS
  value: ""
{{- /* compiler caches under the writable /tmp (the root file system is read-only) */}}
- name: TRITON_CACHE_DIR
  value: /tmp/triton
{{- with (include "kvserve.adminKeysSecret" .) }}
- name: KVSERVE_ADMIN_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.adminApiKeys.secretKey }}
{{- end }}
{{- with (include "kvserve.redisSecret" .) }}
- name: KVSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.secretKey }}
{{- end }}
{{- end -}}

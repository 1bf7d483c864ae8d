{{/*
Names and labels.
*/}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* RayCluster names its pods and services after itself: keep room for their suffixes. */}}
{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "baton.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "baton.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "baton.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
The router's port: the config's router.port (cluster/config.py's default when unset).
*/}}
{{- define "baton.routerPort" -}}
{{- $port := int (dig "router" "port" 50051 .Values.config) -}}
{{- if eq $port 0 -}}
{{- fail "config.router.port: 0 (any free port) cannot work behind a Service; set a port" -}}
{{- end -}}
{{- $port -}}
{{- end -}}

{{/*
The router's OpenAI-compatible HTTP port: the config's router.http_port (cluster/config.py's
default when unset); 0 = no HTTP API (no container port, no Service port).
*/}}
{{- define "baton.httpPort" -}}
{{- int (dig "router" "http_port" 8000 .Values.config) -}}
{{- end -}}

{{/*
A pool's shape, as YAML (use with fromYaml): ranks per replica, GPUs per pod, pods, and
the Ray resource (and units of it per pod) that pins the pool's ranks to its worker
group. A pod holds whole pipeline stages (a stage's tensor-parallel ranks share a node);
a replica's stages may span pods. Fails on combinations that cannot be scheduled. Call
with (list $ "prefill").
*/}}
{{- define "baton.pool" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $cfg := $root.Values.config -}}
{{- $tp := int (dig $role "tensor_parallel" 1 $cfg) -}}
{{- $pp := int (dig $role "pipeline_parallel" 1 $cfg) -}}
{{- $replicas := int (dig $role "replicas" 1 $cfg) -}}
{{- $device := dig $role "device" "auto" $cfg -}}
{{- $group := index $root.Values.workers $role -}}
{{- $ranks := mul $tp $pp -}}
{{- $gpus := 0 -}}
{{- $units := $ranks -}}
{{- $pods := $replicas -}}
{{- if not (kindIs "invalid" $group.gpusPerPod) -}}
{{- if eq $device "cpu" -}}
{{- fail (printf "workers.%s.gpusPerPod is set but config.%s.device is cpu" $role $role) -}}
{{- end -}}
{{- $gpus = int $group.gpusPerPod -}}
{{- if lt $gpus $tp -}}
{{- fail (printf "workers.%s.gpusPerPod (%d) is smaller than config.%s.tensor_parallel (%d): a pipeline stage's ranks must share a pod" $role $gpus $role $tp) -}}
{{- end -}}
{{- if mod $gpus $tp -}}
{{- fail (printf "workers.%s.gpusPerPod (%d) is not a multiple of config.%s.tensor_parallel (%d): a pod holds whole pipeline stages" $role $gpus $role $tp) -}}
{{- end -}}
{{- $total := mul $replicas $ranks -}}
{{- if mod $total $gpus -}}
{{- fail (printf "config.%s needs replicas x tensor_parallel x pipeline_parallel = %d x %d x %d = %d GPUs, not a multiple of workers.%s.gpusPerPod (%d)" $role $replicas $tp $pp $total $role $gpus) -}}
{{- end -}}
{{- $pods = div $total $gpus -}}
{{- $units = $gpus -}}
{{- else if ne $device "cpu" -}}
{{- $gpus = $ranks -}}
{{- end -}}
ranks: {{ $ranks }}
gpusPerPod: {{ $gpus }}
pods: {{ $pods }}
resource: {{ dig $role "node_resource" (printf "baton_%s" $role) $cfg }}
units: {{ $units }}
{{- end -}}

{{/*
config.model.path: model.mountPath unless set, and then it must lie under the mount.
Fails unless exactly one model source is set.
*/}}
{{- define "baton.modelPath" -}}
{{- $m := .Values.model -}}
{{- if and (not $m.pvc.claimName) (not $m.hostPath.path) -}}
{{- fail "model: set model.pvc.claimName or model.hostPath.path; the workers load the weights from that volume" -}}
{{- end -}}
{{- if and $m.pvc.claimName $m.hostPath.path -}}
{{- fail "model: set only one of model.pvc.claimName and model.hostPath.path" -}}
{{- end -}}
{{- $mount := trimSuffix "/" $m.mountPath -}}
{{- $path := dig "model" "path" "" .Values.config | default $mount -}}
{{- if not (or (eq $path $mount) (hasPrefix (printf "%s/" $mount) $path)) -}}
{{- fail (printf "config.model.path (%s) is not under model.mountPath (%s), the only volume with weights" $path $mount) -}}
{{- end -}}
{{- $path -}}
{{- end -}}

{{/*
The cluster config the head runs: .Values.config plus what the chart owns.
*/}}
{{- define "baton.clusterConfig" -}}
{{- $host := dig "router" "host" "127.0.0.1" .Values.config -}}
{{- if has $host (list "127.0.0.1" "localhost" "::1") -}}
{{- fail (printf "config.router.host (%s) is loopback: the Service and the probes reach the router on the pod's address; use 0.0.0.0" $host) -}}
{{- end -}}
{{- $metricsHost := dig "metrics" "host" "127.0.0.1" .Values.config -}}
{{- if and (include "baton.metricsEnabled" .) (has $metricsHost (list "127.0.0.1" "localhost" "::1")) -}}
{{- fail (printf "config.metrics.host (%s) is loopback: Prometheus scrapes each pod on its address; use 0.0.0.0" $metricsHost) -}}
{{- end -}}
{{- if hasKey (dig "metrics" (dict) .Values.config) "port" -}}
{{- fail "config.metrics.port: set the chart's metrics.port instead (every pod opens it)" -}}
{{- end -}}
{{- /* The cross-field checks of ClusterConfig.__post_init__, here to fail before install. */ -}}
{{- if lt (int (dig "decode" "replicas" 1 .Values.config)) 1 -}}
{{- fail "config.decode.replicas: must be >= 1" -}}
{{- end -}}
{{- if and (lt (int (dig "prefill" "replicas" 1 .Values.config)) 1) (ne (dig "router" "disaggregation" "auto" .Values.config) "never") -}}
{{- fail "config.prefill.replicas: 0 prefill workers needs config.router.disaggregation: never" -}}
{{- end -}}
{{- $spec := dig "decode" "speculative" (dict) .Values.config -}}
{{- if and $spec.method (or (gt (int (dig "decode" "tensor_parallel" 1 .Values.config)) 1) (gt (int (dig "decode" "pipeline_parallel" 1 .Values.config)) 1)) -}}
{{- fail "config.decode.speculative.method: speculative decoding needs single-rank decode replicas (config.decode.tensor_parallel and pipeline_parallel 1)" -}}
{{- end -}}
{{- if and (eq (toString $spec.method) "draft") (not $spec.draft_model) -}}
{{- fail "config.decode.speculative: method: draft needs draft_model (the draft model's directory)" -}}
{{- end -}}
{{- with $spec.draft_model -}}
{{- $mount := trimSuffix "/" $.Values.model.mountPath -}}
{{- if not (hasPrefix (printf "%s/" $mount) .) -}}
{{- fail (printf "config.decode.speculative.draft_model (%s) is not under model.mountPath (%s), the only volume with weights" . $mount) -}}
{{- end -}}
{{- end -}}
{{- $cfg := deepCopy .Values.config -}}
{{- range $section := list "model" "prefill" "decode" "metrics" -}}
{{- if not (hasKey $cfg $section) -}}
{{- $_ := set $cfg $section (dict) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $cfg.model "path" (include "baton.modelPath" .) -}}
{{- $_ := set $cfg.metrics "port" (int .Values.metrics.port) -}}
{{- range $role := list "prefill" "decode" -}}
{{- $pool := include "baton.pool" (list $ $role) | fromYaml -}}
{{- $_ := set (index $cfg $role) "node_resource" $pool.resource -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
Environment of every Ray container.
*/}}
{{- define "baton.env" -}}
{{- if .Values.rayAuth.secretName }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.rayAuth.secretName }}
      key: auth_token
{{- end }}
{{- with .Values.ucx.tls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with .Values.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Volumes of every Ray pod: /dev/shm in memory, the weights read-only.
*/}}
{{- define "baton.volumes" -}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
- name: model
  {{- if .Values.model.pvc.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
  {{- else }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
  {{- end }}
{{- end -}}

{{- define "baton.volumeMounts" -}}
- name: shm
  mountPath: /dev/shm
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
  {{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end -}}

{{/*
Pod-level settings shared by every Ray pod; call with (list $ $group) where $group holds
nodeSelector / tolerations / affinity that replace the global ones when not empty.
`volumes` comes last, so that the head can append its config volume.
*/}}
{{- define "baton.podSpec" -}}
{{- $root := index . 0 -}}
{{- $group := index . 1 -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $root.Values.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with ($group.nodeSelector | default $root.Values.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($group.tolerations | default $root.Values.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($group.affinity | default $root.Values.affinity) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  {{- include "baton.volumes" $root | nindent 2 }}
{{- end -}}

{{- define "baton.podMetadata" -}}
{{- with .Values.podLabels }}
labels:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
"true" when the cluster serves metrics (config.metrics.enabled, default true), else "".
*/}}
{{- define "baton.metricsEnabled" -}}
{{- if ne (toString (dig "metrics" "enabled" true .Values.config)) "false" -}}true{{- end -}}
{{- end -}}

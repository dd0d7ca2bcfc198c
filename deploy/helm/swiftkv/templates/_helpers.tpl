{{- define "swiftkv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "swiftkv.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "swiftkv.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "swiftkv.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "swiftkv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "swiftkv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include with (list $ "gateway") */}}
{{- define "swiftkv.selector" -}}
app.kubernetes.io/name: {{ include "swiftkv.name" (index . 0) }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "swiftkv.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{- define "swiftkv.engineImage" -}}
{{- if eq .Values.engines.accelerator "gpu" -}}{{ toYaml .Values.images.engineGpu }}{{- else -}}{{ toYaml .Values.images.engineCpu }}{{- end -}}
{{- end -}}

{{/* The gateway runs the engine image in inprocess mode (torch and vLLM inside), the torch-free one otherwise. */}}
{{- define "swiftkv.gatewayImage" -}}
{{- if eq .Values.engines.mode "inprocess" -}}{{ include "swiftkv.engineImage" . }}{{- else -}}{{ toYaml .Values.images.gateway }}{{- end -}}
{{- end -}}

{{- define "swiftkv.modelsClaim" -}}
{{- .Values.models.persistence.existingClaim | default (printf "%s-models" (include "swiftkv.fullname" .)) -}}
{{- end -}}

{{- define "swiftkv.dataClaim" -}}
{{- .Values.batchStore.persistence.existingClaim | default (printf "%s-data" (include "swiftkv.fullname" .)) -}}
{{- end -}}

{{- define "swiftkv.trainerClaim" -}}
{{- .Values.trainer.persistence.existingClaim | default (printf "%s-trainer" (include "swiftkv.fullname" .)) -}}
{{- end -}}

{{- define "swiftkv.keysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "swiftkv.fullname" .)) -}}
{{- end -}}

{{- define "swiftkv.keysEnabled" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.keys -}}true{{- end -}}
{{- end -}}

{{- define "swiftkv.rayService" -}}
{{- printf "%s-engines" (include "swiftkv.fullname" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "swiftkv.poolService" -}}
{{- printf "%s-engine-%s" (include "swiftkv.fullname" (index . 0)) (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "swiftkv.servedName" -}}
{{- $root := index . 0 -}}{{- $pool := index $root.Values.platform.pools (index . 1) -}}
{{- $pool.served_model_name | default (printf "%s-%s" $root.Values.platform.model (index . 1)) -}}
{{- end -}}

{{/* platform.yaml: the values' platform block plus what the chart decides (listen address, paths, backends). */}}
{{/* The RayService head's GCS address. The gateway joins the cluster there as a node without resources (its driver
streams from the deployments' handles, which Ray Client, ray://, cannot). */}}
{{- define "swiftkv.rayHead" -}}
{{- printf "%s-head-svc:6379" (include "swiftkv.rayService" .) -}}
{{- end -}}

{{/* The Ray Serve application of a pool: named in the RayService's serveConfigV2 and, as the pool's ray_app,
in the platform config the gateway reads to attach to it. */}}
{{- define "swiftkv.rayApp" -}}
swiftkv-{{ . }}
{{- end -}}

{{- define "swiftkv.platformConfig" -}}
{{- $cfg := deepCopy .Values.platform -}}
{{- $_ := set $cfg "host" "0.0.0.0" -}}
{{- $_ := set $cfg "port" (int .Values.gateway.port) -}}
{{- $_ := set $cfg "data_dir" "/var/lib/swiftkv" -}}
{{- /* the release's own Redis keys and channels: releases sharing one Redis keep their own limits and live traffic */ -}}
{{- $_ := set $cfg "redis_prefix" .Release.Name -}}
{{- if include "swiftkv.keysEnabled" . -}}
{{- $_ := set $cfg "api_keys_file" (printf "/etc/swiftkv/keys/%s" .Values.apiKeys.existingSecretKey) -}}
{{- end -}}
{{- if eq .Values.engines.mode "kuberay" -}}
{{- $_ := set $cfg "ray_address" (include "swiftkv.rayHead" .) -}}
{{- range $name, $pool := $cfg.pools -}}
{{- if ne ($pool.backend | default "engine") "remote" -}}
{{- $_ := set $pool "ray_app" (include "swiftkv.rayApp" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.engines.mode "deployments" -}}
{{- $pools := dict -}}
{{- range $name, $pool := .Values.platform.pools -}}
{{- $served := include "swiftkv.servedName" (list $ $name) -}}
{{- $remote := dict "backend" "remote" "model" $pool.model "tokenizer" ($pool.tokenizer | default $pool.model) "served_model_name" $served "url" (printf "http://%s:8000/v1" (include "swiftkv.poolService" (list $ $name))) -}}
{{- /* the servers' key, from the Secret through the gateway's environment: this file is a ConfigMap */ -}}
{{- $_ := set $remote "api_key_env" "SWIFTKV_ENGINE_API_KEY" -}}
{{- if include "swiftkv.kvEvents" $ -}}
{{- $_ := set $remote "kv_events_endpoint" (printf "tcp://%s:5557" (include "swiftkv.poolService" (list $ $name))) -}}
{{- end -}}
{{- if $pool.dual_mode -}}
{{- $_ := set $remote "dual_mode" true -}}
{{- end -}}
{{- with $pool.slo -}}
{{- $_ := set $remote "slo" . -}}
{{- end -}}
{{- $_ := set $pools $name $remote -}}
{{- end -}}
{{- $_ := set $cfg "pools" $pools -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* "true" when the gateway follows the engines' KV-cache events (platform.routing.kv_events): each engine server
publishes them on port 5557 and the gateway subscribes there. */}}
{{- define "swiftkv.kvEvents" -}}
{{- $routing := .Values.platform.routing | default dict -}}
{{- if and $routing.kv_events (ne (toString $routing.cache_aware) "false") -}}true{{- end -}}
{{- end -}}

{{/* A pool's `speculative` as vLLM's --speculative-config JSON (unset fields left out); empty when it is off. */}}
{{- define "swiftkv.speculativeConfig" -}}
{{- $spec := . | default dict -}}
{{- if and $spec.method (ne $spec.method "none") -}}
{{- $out := dict -}}
{{- range $k, $v := $spec -}}
{{- if not (kindIs "invalid" $v) -}}{{- $_ := set $out $k $v -}}{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
{{- end -}}

{{/* vLLM engine_args as `vllm serve` flags: max_model_len: 2048 -> --max-model-len 2048, true -> the bare flag. */}}
{{- define "swiftkv.vllmFlags" -}}
{{- range $k, $v := . }}
{{- if eq (kindOf $v) "bool" }}
{{- if $v }}
- --{{ $k | replace "_" "-" }}
{{- end }}
{{- else if or (eq (kindOf $v) "map") (eq (kindOf $v) "slice") }}
- --{{ $k | replace "_" "-" }}
- {{ toJson $v | quote }}
{{- else }}
- --{{ $k | replace "_" "-" }}
- {{ $v | toString | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Init container preparing the models offline (serialised by a lock: several pods share the PVC). */}}
{{- define "swiftkv.prepareModels" -}}
{{- if .Values.models.prepare }}
- name: prepare-models
  image: {{ include "swiftkv.image" (include "swiftkv.engineImage" . | fromYaml) }}
  imagePullPolicy: {{ (include "swiftkv.engineImage" . | fromYaml).pullPolicy }}
  command: [sh, -c]
  args:
    - |
      set -e
      for name in {{ join " " .Values.models.prepare }}; do
        flock /models/.prepare.lock swiftkv models prepare "$name" --dir /models
      done
  env:
    - {name: HOME, value: /tmp}   # caches under the writable /tmp, not the read-only root
  securityContext: {{- include "swiftkv.securityContext" . | nindent 4 }}
  volumeMounts:
    - {name: models, mountPath: /models}
    - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end -}}

{{- define "swiftkv.modelsVolume" -}}
- name: models
{{- if .Values.models.persistence.enabled }}
  persistentVolumeClaim: {claimName: {{ include "swiftkv.modelsClaim" . }}}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "swiftkv.engineResources" -}}
{{- $r := deepCopy .Values.engines.resources -}}
{{- if eq .Values.engines.accelerator "gpu" -}}
{{- $limits := $r.limits | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .Values.engines.gpusPerEngine) -}}
{{- $_ := set $r "limits" $limits -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* "true" when the gateway can run several pods (replicas or autoscaling). */}}
{{- define "swiftkv.gatewayScales" -}}
{{- if or (gt (int .Values.gateway.replicas) 1) .Values.gateway.autoscaling.enabled -}}true{{- end -}}
{{- end -}}

{{/* "true" when a persistence block (models, batchStore) gives pods on several nodes the same files. */}}
{{- define "swiftkv.sharedVolume" -}}
{{- if and .enabled (has "ReadWriteMany" .accessModes) -}}true{{- end -}}
{{- end -}}

{{/* A NetworkPolicy peer from a {namespace, podLabels} value: both must match ("" is the release's namespace). */}}
{{- define "swiftkv.peer" -}}
{{- $root := index . 0 -}}{{- $peer := index . 1 -}}
- namespaceSelector:
    matchLabels: {kubernetes.io/metadata.name: {{ $peer.namespace | default $root.Release.Namespace | quote }}}
  podSelector:
    matchLabels: {{- toYaml $peer.podLabels | nindent 6 }}
{{- end -}}

{{/* The user's peers (gatewayFrom, trainerFrom) as given; one whose podSelector comes with `namespaceSelector: {}`
admits a pod in any namespace that copies the labels, and is refused. */}}
{{- define "swiftkv.userPeers" -}}
{{- $name := index . 0 -}}{{- $peers := index . 1 -}}
{{- range $i, $peer := $peers -}}
{{- if and (hasKey $peer "podSelector") (hasKey $peer "namespaceSelector") (empty $peer.namespaceSelector) -}}
{{- fail (printf "networkPolicy.%s[%d]: namespaceSelector {} with a podSelector admits a pod in any namespace that carries those labels; name the namespace (namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: NAME}}), or leave namespaceSelector out for this release's namespace" $name $i) -}}
{{- end -}}
{{- end -}}
{{- toYaml $peers -}}
{{- end -}}

{{/* What the ServiceMonitor scrapes, as a YAML list of {what, service, match}: each gets an absent() alert. The Ray
workers (the engines) are told from the head by the pod label the ServiceMonitor copies (ray_io_node_type). */}}
{{- define "swiftkv.scrapeTargets" -}}
- {what: the gateway, service: {{ include "swiftkv.fullname" . }}-gateway}
{{- if eq .Values.engines.mode "kuberay" }}
- {what: the engines' Ray workers, service: {{ include "swiftkv.fullname" . }}-ray-metrics, match: 'ray_io_node_type="worker"'}
{{- else if eq .Values.engines.mode "deployments" }}
{{- range $pool, $cfg := .Values.platform.pools }}
{{- if ne ($cfg.backend | default "engine") "remote" }}
- {what: pool {{ $pool }}'s vLLM server, service: {{ include "swiftkv.poolService" (list $ $pool) }}}
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.trainer.enabled }}
- {what: the trainer, service: {{ include "swiftkv.fullname" . }}-trainer}
{{- end }}
{{- end -}}

{{/* A container's securityContext: the values' plus a read-only root filesystem, which is not optional: each
process writes only to its volumes (/tmp with HOME=/tmp for caches and Ray's /tmp/ray, /models, the data dir). */}}
{{- define "swiftkv.securityContext" -}}
{{- toYaml (merge (dict "readOnlyRootFilesystem" true) (deepCopy .Values.securityContext)) -}}
{{- end -}}

{{/* Ray's ports, pinned on every node of the cluster (head, workers, the gateway) so the NetworkPolicies can name
them; Ray's defaults pick the node manager's and object manager's at random. */}}
{{- define "swiftkv.rayPorts" -}}
node-manager-port: "6380"
object-manager-port: "6381"
dashboard-agent-grpc-port: "6382"
dashboard-agent-listen-port: "52365"
runtime-env-agent-port: "6383"
min-worker-port: "10002"
max-worker-port: "19999"
{{- end -}}

{{/* NetworkPolicy ports another Ray node reaches on a node: GCS (the head), raylet, object manager, the dashboard
agent (the head's dashboard asks it) and the worker processes (actors, drivers). The runtime-env agent is asked by
its own node only; the dashboard (8265, its job API runs code) and Ray Client (10001) are not among them. */}}
{{- define "swiftkv.rayNodePorts" -}}
{{- $p := include "swiftkv.rayPorts" . | fromYaml -}}
- {port: {{ index $p "node-manager-port" }}, protocol: TCP}   # raylet
- {port: {{ index $p "object-manager-port" }}, protocol: TCP}   # object transfers
- {port: {{ index $p "dashboard-agent-grpc-port" }}, protocol: TCP}   # dashboard agent (gRPC)
- {port: {{ index $p "dashboard-agent-listen-port" }}, protocol: TCP}   # dashboard agent (HTTP)
- {port: {{ index $p "min-worker-port" }}, endPort: {{ index $p "max-worker-port" }}, protocol: TCP}   # worker processes
{{- end -}}

{{/* The vLLM servers' API key (engines.mode deployments): engines.apiKey.existingSecret or the chart's own. */}}
{{- define "swiftkv.engineKeySecret" -}}
{{- .Values.engines.apiKey.existingSecret | default (printf "%s-engine-api-key" (include "swiftkv.fullname" .)) -}}
{{- end -}}

{{- define "swiftkv.engineKeyRef" -}}
{name: {{ include "swiftkv.engineKeySecret" . }}, key: {{ .Values.engines.apiKey.existingSecretKey }}}
{{- end -}}

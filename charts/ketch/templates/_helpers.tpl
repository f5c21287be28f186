{{/*
The operator's labels, as manifests/ sets them, plus .Values.commonLabels. The chart adds no
Helm-only labels (helm.sh/chart, app.kubernetes.io/managed-by: Helm, ...), so that it renders
what the kustomize overlays do; Helm finds its objects by its own annotations.
*/}}
{{- define "ketch.labels" -}}
app.kubernetes.io/name: ketch-operator
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: ketch
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The operator image's version: image.tag, else the chart's appVersion. */}}
{{- define "ketch.version" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end }}

{{/* The operator image reference: repository@digest, else repository:tag. */}}
{{- define "ketch.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (include "ketch.version" .) -}}
{{- end -}}
{{- end }}

{{/*
The rules the operator needs, in a ClusterRole (cluster-wide) or a Role (one namespace); only
kopf's peering resource differs. The same list as the rbac.yaml of both manifests/overlays.
*/}}
{{- define "ketch.rules" -}}
# Watched, never written: the operator only writes status (GitOps tools own the spec), with
# merge patches. Nothing here is ever replaced (PUT), so no rule grants update.
- apiGroups: [serving.ketch.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch]
- apiGroups: [serving.ketch.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
# The children: server-side applied (patch, and create when one is new), watched for drift,
# deleted when no longer wanted.
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
# Coordinated autoscaling (mode ketch) sets replicas as an HPA does, through /scale.
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# Autoscalers per role: HPAs (mode hpa) and KEDA ScaledObjects (mode keda; never watched,
# so the operator works without KEDA installed).
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
# Engine pods are read for status (crash loops, image pulls, unschedulable pods).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# core/v1 Events, posted (the operator's and kopf's); never patched or aggregated.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# kopf peering: keep-alives in the peering object's status.
- apiGroups: [kopf.dev]
  resources: [{{ if .Values.watchNamespace }}kopfpeerings{{ else }}clusterkopfpeerings{{ end }}]
  verbs: [get, list, watch, patch]
# Gateway API Inference Extension: the InferencePool and HTTPRoute children.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, list, watch, create, update, patch, delete]
{{- end }}

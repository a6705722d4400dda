{{/* Standard names and labels, one place (helm create conventions). */}}
{{- define "ember.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ember.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ember.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "ember.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ember.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ember.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ember.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "ember.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* registry/name:tag for one of Ember's images. */}}
{{- define "ember.image" -}}
{{- $root := index . 0 -}}{{- $name := index . 1 -}}
{{- printf "%s/%s:%s" $root.Values.image.registry $name (default $root.Chart.AppVersion $root.Values.image.tag) -}}
{{- end -}}

{{- define "ember.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The ClusterRole bound to the runtime's ServiceAccount in each served namespace. */}}
{{- define "ember.runtimeRole" -}}
{{- printf "%s-runtime" (include "ember.fullname" .) -}}
{{- end -}}

{{/* PodStatus fields besides conditions: a runtime's status write must leave each as it is.
     A field added by a later Kubernetes is not listed, so it is not checked: review on upgrade. */}}
{{- define "ember.podStatusFields" -}}
{{- list "phase" "message" "reason" "nominatedNodeName" "hostIP" "hostIPs" "podIP" "podIPs" "startTime" "initContainerStatuses" "containerStatuses" "ephemeralContainerStatuses" "qosClass" "resize" "resourceClaimStatuses" "observedGeneration" | toJson -}}
{{- end -}}

{{/* CEL: `object.<path>` equals `oldObject.<path>`, absent in both counting as equal. */}}
{{- define "ember.celUnchanged" -}}
{{- $parent := index . 0 -}}{{- $field := index . 1 -}}
(has(object.{{ $parent }}.{{ $field }}) == has(oldObject.{{ $parent }}.{{ $field }}) && (!has(object.{{ $parent }}.{{ $field }}) || object.{{ $parent }}.{{ $field }} == oldObject.{{ $parent }}.{{ $field }}))
{{- end -}}

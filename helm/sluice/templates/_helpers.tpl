{{/* Name helpers and common labels. */}}
{{- define "sluice.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- /*
A Service's name: the fullname cut so that "<fullname>-<suffix>" stays a DNS label of at most 63
characters (a 53-character release name would otherwise make the Service invalid). Called with
(list . "suffix").
*/}}
{{- define "sluice.serviceName" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- printf "%s-%s" (include "sluice.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix -}}
{{- end -}}

{{- define "sluice.labels" -}}
app.kubernetes.io/name: sluice-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: sluice-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- /*
prometheus-adapter rules (its config format) serving the runtime's per-pod metrics under the names the
operator's HPAs ask for. <<.Series>>, <<.LabelMatchers>> and <<.GroupBy>> are prometheus-adapter's own
template (delimiters << >>), filled per request: the namespace and pod label matchers, grouped by pod.
*/}}
{{- define "sluice.prometheusAdapterRules" -}}
{{- $r := .Values.autoscaling.prometheusAdapter.rules -}}
{{- if eq $r.namespaceLabel $r.podLabel -}}
{{- fail "autoscaling.prometheusAdapter.rules: namespaceLabel and podLabel must be different labels" -}}
{{- end -}}
{{- $resources := dict "overrides" (dict $r.namespaceLabel (dict "resource" "namespace") $r.podLabel (dict "resource" "pod")) -}}
{{- $series := printf "{%s!=\"\",%s!=\"\"}" $r.namespaceLabel $r.podLabel -}}
{{- $latency := printf "(histogram_quantile(0.9, sum by (le, <<.GroupBy>>) (rate(<<.Series>>{<<.LabelMatchers>>}[%s]))) >= 0) or (0 * sum by (<<.GroupBy>>) (rate(sluice_queue_duration_seconds_count{<<.LabelMatchers>>}[%s])))" $r.rateInterval $r.rateInterval -}}
{{- $rules := list
  (dict "seriesQuery" (printf "sluice_queue_depth%s" $series) "resources" $resources
        "name" (dict "matches" "^sluice_queue_depth$" "as" "sluice_queue_depth")
        "metricsQuery" "sum by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})")
  (dict "seriesQuery" (printf "sluice_inflight_requests%s" $series) "resources" $resources
        "name" (dict "matches" "^sluice_inflight_requests$" "as" "sluice_inflight_requests")
        "metricsQuery" "max by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})")
  (dict "seriesQuery" (printf "sluice_queue_duration_seconds_bucket%s" $series) "resources" $resources
        "name" (dict "matches" "^sluice_queue_duration_seconds_bucket$" "as" "sluice_queue_duration_seconds_p90")
        "metricsQuery" $latency)
-}}
{{- toYaml $rules -}}
{{- end -}}

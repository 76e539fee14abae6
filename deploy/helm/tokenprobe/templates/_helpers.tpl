{{- define "tokenprobe.labels" -}}
app.kubernetes.io/name: tokenprobe
app.kubernetes.io/component: agent
{{- end }}

{{- define "tokenprobe.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

"""Exporters: the agent's Prometheus endpoint and OTLP traces."""

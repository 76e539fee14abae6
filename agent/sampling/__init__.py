"""Sampling: GPU state (NVML, dcgm-exporter) and inference engines' own /metrics."""

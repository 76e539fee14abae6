"""The Streamlit dashboard.

``tokenprobe dashboard`` (``cli``) serves ``app``, which lays out what
``queries`` aggregates in ClickHouse: latency heatmaps with a drill-down to
single requests, the phase breakdown, GPU state, the indicator matrix and the
actuator decisions. ``synthetic`` generates fleet traffic inside ClickHouse to
try it on, and for its benchmark.
"""

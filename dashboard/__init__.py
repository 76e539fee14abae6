"""The Streamlit dashboard.

``tokenprobe dashboard`` (``cli``) serves ``app`` (through ``streamlit_app``,
the script Streamlit runs), which lays out what ``queries`` aggregates in
ClickHouse: latency heatmaps with a drill-down to single requests, the phase
breakdown, GPU state, the indicator matrix and the actuator decisions.
``refserver.fleet`` generates fleet traffic inside ClickHouse to try it on.
"""

"""What every room agrees on, importing nothing of the project.

- ``tables``: how a table is declared (columns, codecs, engine, TTL);
  ``registry``: the one ordered list of tables and views.
- ``requests``, ``samples``, ``analysis``, ``decisions``, ``rollup``, ``views``:
  the tables and views themselves, each beside the values it stores.
- ``measures``: the SQL definition of every figure (TTFT, TPOT, ITL, e2e, …);
  ``latency``: the latencies the heatmaps band.
- ``decisions``: what the controller decides and the gateways enforce.
- ``apis``: the one table of APIs (routes, dialect, GenAI operation, inference) and the one rule for
  "inference request", for the agent, the analytics, the dashboard and the gateway.
- ``tenant``: the tenant rule (which header names a request's tenant, and how its value is kept).
"""

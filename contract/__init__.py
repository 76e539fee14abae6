"""What every room agrees on, importing nothing of the project.

- ``tables``: how a table is declared (columns, codecs, engine, TTL);
  ``registry``: the one ordered list of tables and views.
- ``requests``, ``samples``, ``analysis``, ``decisions``, ``rollup``, ``views``:
  the tables and views themselves, each beside the values it stores.
- ``measures``: the SQL definition of every figure (TTFT, TPOT, ITL, e2e, …);
  ``latency``: the latencies the heatmaps band.
- ``decisions``: what the controller decides and the gateways enforce.
- ``routes``: every inference route of every API dialect, one list for the agent and the gateway.
- ``tenant``: the tenant rule (which header names a request's tenant, and how its value is kept).
"""

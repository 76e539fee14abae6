"""``request_ends``: when each inference request ended, kept by a materialized view, for the live analysis.

The live analysis (``analytics/live.py``) analyses, every window, the requests
that *ended* in it, but ``requests`` is sorted by server and start: finding
them there means reading every request that could still have been running, an
hour of them. ``request_ends`` holds, per inference request, its end
(``measures.ENDED_AT``), node, server and start, sorted by node and end, so a
pass reads one window of it and learns where in ``requests`` its rows lie.
``request_ends_mv`` adds to it on every insert into ``requests`` (a replayed
batch deduplicates as there); rows stored before the view existed are not in
it, so a pass that may need them (the first after the agent starts) reads
``requests`` instead.
"""

from __future__ import annotations

from . import measures
from .requests import REQUESTS_TABLE
from .tables import (
    DEDUPLICATION_WINDOW_SETTING,
    INTEGER_CODEC,
    OPAQUE_CODEC,
    SORTED_TIMESTAMP_CODEC,
    TIMESTAMP_CODEC,
    TIMESTAMP_TYPE,
    Column,
    Table,
    View,
)

REQUEST_ENDS_TABLE = "request_ends"
REQUEST_ENDS_VIEW = "request_ends_mv"

REQUEST_ENDS = Table(
    REQUEST_ENDS_TABLE,
    (
        Column("node", "LowCardinality(String)", OPAQUE_CODEC),
        Column("ended_at", TIMESTAMP_TYPE, SORTED_TIMESTAMP_CODEC),
        Column("server_port", "UInt16", INTEGER_CODEC),
        Column("req_start", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    ),
    partition_by="ended_at", order_by="node, ended_at", ttl_column="ended_at",
    settings=DEDUPLICATION_WINDOW_SETTING,
)
REQUEST_ENDS_VIEW_DDL = f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.{REQUEST_ENDS_VIEW} TO {{db}}.{REQUEST_ENDS_TABLE} AS
SELECT node, assumeNotNull({measures.ENDED_AT}) AS ended_at, server_port, req_start
FROM {{db}}.{REQUESTS_TABLE}
WHERE {measures.IS_INFERENCE}"""

REQUEST_ENDS_MV = View(REQUEST_ENDS_VIEW, REQUEST_ENDS_VIEW_DDL)

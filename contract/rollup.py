"""A per-minute rollup of request latency bands, kept by a materialized view, for fast heatmaps.

``request_latency_bands`` counts the served requests per minute, server
(``node``, ``server_port``), model, route, latency metric and band (10 per
decade), plus the pseudo-metric ``all`` that counts every served request.
For ITL its ``requests`` column counts inter-token gaps.
The materialized view ``request_latency_bands_mv`` adds to it on every insert
into ``tokenprobe.requests``, so a heatmap over a day reads a few hundred
thousand rows instead of every request of the day.

The view sees only rows inserted after it was created. Readers therefore use
the rollup for a window only where its ``all`` count equals the number of
requests in the window, and scan the requests otherwise (see
``DashboardQueries.heatmap_source``). A store made by an older release gets
the current view from ``Store.ensure_schema``: the minutes rolled up before
it lack the metrics added since, so that check counts the metric itself. Whoever creates the store's schema (the
agent) creates both, so the rollup starts with the store.
"""

from __future__ import annotations

from .latency import DEFAULT_BANDS_PER_DECADE, METRICS, band_sql
from .requests import REQUESTS_TABLE
from .tables import (
    DEDUPLICATION_WINDOW_SETTING,
    INTEGER_CODEC,
    OPAQUE_CODEC,
    TIMESTAMP_CODEC,
    Column,
    Table,
    View,
)

ROLLUP_TABLE = "request_latency_bands"
ROLLUP_VIEW = "request_latency_bands_mv"
ROLLUP_STEP_S = 60
ROLLUP_BANDS_PER_DECADE = DEFAULT_BANDS_PER_DECADE
ALL_REQUESTS = "all"  # the pseudo-metric that counts every served request

_LABEL = "LowCardinality(String)"
ROLLUP = Table(
    ROLLUP_TABLE,
    (
        Column("minute", "DateTime('UTC')", TIMESTAMP_CODEC),
        Column("node", _LABEL, OPAQUE_CODEC),
        Column("server_port", "UInt16", INTEGER_CODEC),
        Column("model", _LABEL, OPAQUE_CODEC),
        Column("path", _LABEL, OPAQUE_CODEC),
        Column("metric", _LABEL, OPAQUE_CODEC),
        Column("band", "Int16", INTEGER_CODEC),
        Column("requests", "UInt64", INTEGER_CODEC),
    ),
    engine="SummingMergeTree(requests)",
    partition_by="minute", order_by="metric, minute, node, server_port, model, path, band", ttl_column="minute",
    settings=DEDUPLICATION_WINDOW_SETTING,  # a replayed batch must not count twice here either
)

# Each request yields one (metric, band) pair per latency it has, one ('itl', band) pair per
# inter-token gap, and ('all', 0).
_REQUEST_BANDS = ", ".join(
    [f"('{key}', if({metric.condition}, {band_sql(metric.sql, str(ROLLUP_BANDS_PER_DECADE))}, NULL))"
     for key, metric in METRICS.items() if not metric.per_gap]
    + [f"('{ALL_REQUESTS}', 0)"]
)
_GAP_BANDS = ", ".join(
    f"arrayMap(band -> ('{key}', band), {metric.bands_sql(str(ROLLUP_BANDS_PER_DECADE))})"
    for key, metric in METRICS.items() if metric.per_gap
)
ROLLUP_VIEW_DDL = f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.{ROLLUP_VIEW} TO {{db}}.{ROLLUP_TABLE} AS
SELECT
    toStartOfMinute(toDateTime(req_start, 'UTC')) AS minute,
    node, server_port, model, path,
    metric_band.1 AS metric,
    toInt16(assumeNotNull(metric_band.2)) AS band,
    count() AS requests
FROM {{db}}.{REQUESTS_TABLE}
ARRAY JOIN arrayConcat(arrayFilter(pair -> pair.2 IS NOT NULL, [{_REQUEST_BANDS}]), {_GAP_BANDS}) AS metric_band
WHERE role = 'server'
GROUP BY minute, node, server_port, model, path, metric, band"""

ROLLUP_MV = View(ROLLUP_VIEW, ROLLUP_VIEW_DDL)

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

from . import measures
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
_MINUTE_SERVER_MODEL = (  # the key both rollups start with
    Column("minute", "DateTime('UTC')", TIMESTAMP_CODEC),
    Column("node", _LABEL, OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("model", _LABEL, OPAQUE_CODEC),
)
ROLLUP = Table(
    ROLLUP_TABLE,
    (
        *_MINUTE_SERVER_MODEL,
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

# The knee's curves (analytics/knee.py) per minute, server, model and concurrency at arrival (in flight + 1):
# the requests whose TTFT the knee reads and a t-digest of their TTFT, so a live pass merges a few thousand
# digests instead of reading 6 h of requests. ``served`` counts the servers' side as the latency rollup's
# ``all`` does: the knee reads a minute from here only where the two agree (both views saw every row of it).
KNEE_ROLLUP_TABLE = "request_ttft_by_concurrency"
KNEE_ROLLUP_VIEW = "request_ttft_by_concurrency_mv"
# A t-digest, not ClickHouse's default reservoir sample: a minute's reservoir keeps up to 8192 values, so
# merging 360 of them costs about what reading the requests does; a digest keeps ~100 centroids.
TTFT_QUANTILE_LEVELS = "0.5, 0.99"  # quantilesTDigest{State,Merge}(these): p50, p99
KNEE_TTFT_REQUESTS = (f"{measures.IS_INFERENCE} AND status BETWEEN 200 AND 299 AND req_end IS NOT NULL"
                      " AND first_token IS NOT NULL")
KNEE_TTFT_MS = f"toFloat64({measures.SERVER_TTFT.sql_when_known})"  # valid where KNEE_TTFT_REQUESTS holds
KNEE_ROLLUP = Table(
    KNEE_ROLLUP_TABLE,
    (
        *_MINUTE_SERVER_MODEL,
        Column("concurrency", "UInt32", INTEGER_CODEC),
        Column("served", "SimpleAggregateFunction(sum, UInt64)", INTEGER_CODEC),
        Column("requests", "SimpleAggregateFunction(sum, UInt64)", INTEGER_CODEC),
        Column("ttft_ms", f"AggregateFunction(quantilesTDigest({TTFT_QUANTILE_LEVELS}), Float64)", OPAQUE_CODEC),
    ),
    engine="AggregatingMergeTree",
    partition_by="minute", order_by="minute, node, server_port, model, concurrency", ttl_column="minute",
    settings=DEDUPLICATION_WINDOW_SETTING,
)
KNEE_ROLLUP_VIEW_DDL = f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.{KNEE_ROLLUP_VIEW} TO {{db}}.{KNEE_ROLLUP_TABLE} AS
SELECT
    toStartOfMinute(toDateTime(req_start, 'UTC')) AS minute,
    node, server_port, model,
    inflight_at_arrival + 1 AS concurrency,
    countIf(role = 'server') AS served,
    countIf({KNEE_TTFT_REQUESTS}) AS requests,
    quantilesTDigestStateIf({TTFT_QUANTILE_LEVELS})({KNEE_TTFT_MS}, {KNEE_TTFT_REQUESTS}) AS ttft_ms
FROM {{db}}.{REQUESTS_TABLE}
GROUP BY minute, node, server_port, model, concurrency"""

KNEE_ROLLUP_MV = View(KNEE_ROLLUP_VIEW, KNEE_ROLLUP_VIEW_DDL)

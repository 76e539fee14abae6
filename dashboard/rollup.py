"""A per-minute rollup of request latency bands, kept by a materialized view, for fast heatmaps.

``request_latency_bands`` counts the served requests per minute, server
(``node``, ``server_port``), model, route, latency metric and band (10 per
decade), plus the pseudo-metric ``all`` that counts every served request.
The materialized view ``request_latency_bands_mv`` adds to it on every insert
into ``tokenprobe.requests``, so a heatmap over a day reads a few hundred
thousand rows instead of every request of the day.

The view sees only rows inserted after it was created. Readers therefore use
the rollup for a window only where its ``all`` count equals the number of
requests in the window, and scan the requests otherwise (see
``DashboardQueries.heatmap_source``). Both tables are created by
``Store.ensure_schema()`` once this module is imported (it registers them);
the process that creates a store's schema, the agent, should import it so
the rollup starts with the store.
"""

from __future__ import annotations

from tokenprobe.agent import schema
from tokenprobe.agent.schema import REQUESTS_TABLE
from tokenprobe.dashboard.latency import DEFAULT_BANDS_PER_DECADE, METRICS, band_sql

ROLLUP_TABLE = "request_latency_bands"
ROLLUP_VIEW = "request_latency_bands_mv"
ROLLUP_STEP_S = 60
ROLLUP_BANDS_PER_DECADE = DEFAULT_BANDS_PER_DECADE
ALL_REQUESTS = "all"  # the pseudo-metric that counts every served request

ROLLUP_DDL = f"""CREATE TABLE IF NOT EXISTS {{db}}.{ROLLUP_TABLE}
(
    `minute` DateTime('UTC') CODEC(Delta, ZSTD(1)),
    `node` LowCardinality(String) CODEC(ZSTD(1)),
    `server_port` UInt16 CODEC(T64, ZSTD(1)),
    `model` LowCardinality(String) CODEC(ZSTD(1)),
    `path` LowCardinality(String) CODEC(ZSTD(1)),
    `metric` LowCardinality(String) CODEC(ZSTD(1)),
    `band` Int16 CODEC(T64, ZSTD(1)),
    `requests` UInt64 CODEC(T64, ZSTD(1))
)
ENGINE = SummingMergeTree(requests)
PARTITION BY toDate(minute)
ORDER BY (metric, minute, node, server_port, model, path, band)
TTL minute + INTERVAL {{ttl_days}} DAY"""

# Each request yields one (metric, band) pair per latency it has, and ('all', 0).
_METRIC_BANDS = ", ".join(
    [f"('{key}', if({metric.condition}, {band_sql(metric.sql, str(ROLLUP_BANDS_PER_DECADE))}, NULL))"
     for key, metric in METRICS.items()]
    + [f"('{ALL_REQUESTS}', 0)"]
)
ROLLUP_VIEW_DDL = f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.{ROLLUP_VIEW} TO {{db}}.{ROLLUP_TABLE} AS
SELECT
    toStartOfMinute(toDateTime(req_start, 'UTC')) AS minute,
    node, server_port, model, path,
    metric_band.1 AS metric,
    toInt16(assumeNotNull(metric_band.2)) AS band,
    count() AS requests
FROM {{db}}.{REQUESTS_TABLE}
ARRAY JOIN arrayFilter(pair -> pair.2 IS NOT NULL, [{_METRIC_BANDS}]) AS metric_band
WHERE role = 'server'
GROUP BY minute, node, server_port, model, path, metric, band"""

schema.register_table(ROLLUP_TABLE, ROLLUP_DDL)
schema.register_table(ROLLUP_VIEW, ROLLUP_VIEW_DDL)

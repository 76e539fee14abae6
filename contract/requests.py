"""The ``requests`` table: one row per HTTP request the agent saw, the row every figure starts from."""

from __future__ import annotations

from .tables import (
    DEDUPLICATION_WINDOW_SETTING,
    INTEGER_CODEC,
    NULLABLE_TIMESTAMP_TYPE,
    OPAQUE_CODEC,
    SORTED_TIMESTAMP_CODEC,
    TIMESTAMP_CODEC,
    TIMESTAMP_TYPE,
    Column,
    Table,
)

# One row per HTTP request (docs/schema.md is rendered from this list: names,
# types, order). Timestamps carry an explicit UTC zone so every reader decodes
# the same instant whatever the server's or the host's time zone.
REQUEST_SCHEMA: tuple[Column, ...] = (
    Column("node", "LowCardinality(String)", OPAQUE_CODEC),
    Column("conn_id", "UInt64", INTEGER_CODEC),
    Column("req_seq", "UInt32", INTEGER_CODEC),
    Column("role", "LowCardinality(String)", OPAQUE_CODEC),
    Column("pid", "UInt32", INTEGER_CODEC),
    Column("comm", "LowCardinality(String)", OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("client_addr", "String", OPAQUE_CODEC),
    Column("client_port", "UInt16", INTEGER_CODEC),
    Column("tenant", "LowCardinality(String)", OPAQUE_CODEC),
    Column("tls", "Bool", OPAQUE_CODEC),
    Column("accept_ts", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("tls_done_ts", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("req_start", TIMESTAMP_TYPE, SORTED_TIMESTAMP_CODEC),
    Column("req_end", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("resp_start", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("first_token", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("last_token", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("resp_end", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("method", "LowCardinality(String)", OPAQUE_CODEC),
    Column("path", "LowCardinality(String)", OPAQUE_CODEC),
    Column("status", "UInt16", INTEGER_CODEC),
    Column("model", "LowCardinality(String)", OPAQUE_CODEC),
    Column("response_id", "String", OPAQUE_CODEC),
    Column("streamed", "Bool", OPAQUE_CODEC),
    Column("token_events", "UInt32", INTEGER_CODEC),
    Column("sse_events", "UInt32", INTEGER_CODEC),
    Column("token_offsets_us", "Array(UInt32)", OPAQUE_CODEC),
    Column("prompt_tokens", "Nullable(UInt32)", INTEGER_CODEC),
    Column("completion_tokens", "Nullable(UInt32)", INTEGER_CODEC),
    Column("inflight_at_arrival", "UInt32", INTEGER_CODEC),
    Column("bytes_in", "UInt64", INTEGER_CODEC),
    Column("bytes_out", "UInt64", INTEGER_CODEC),
    Column("body_fp", "UInt64", OPAQUE_CODEC),
    Column("outcome", "LowCardinality(String)", OPAQUE_CODEC),
    Column("error", "String", OPAQUE_CODEC),
    # Added with the API dialects (agent/capture/dialects/); older tables gain them on open,
    # and rows from writers that predate them (spooled batches, synthetic data) get the defaults.
    Column("api", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    Column("first_content_token", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("choices", "UInt16", INTEGER_CODEC, default="0"),
    Column("choice_events", "UInt32", INTEGER_CODEC, default="0"),
    Column("engine_prompt_ms", "Nullable(Float32)", OPAQUE_CODEC),
    Column("engine_decode_ms", "Nullable(Float32)", OPAQUE_CODEC),
    # Added with capture fidelity: how the row was seen (exact, gaps, dropped) and the bytes not seen.
    Column("capture", "LowCardinality(String)", OPAQUE_CODEC),
    Column("bytes_unseen", "UInt64", INTEGER_CODEC),
    # Added with HTTP/2 and blind spots: the protocol read, the HTTP/2 stream, gRPC's status, and for an
    # `unsupported` row (a connection that could not be read) why not.
    Column("protocol", "LowCardinality(String)", OPAQUE_CODEC, default="'http/1.1'"),
    Column("stream_id", "UInt32", INTEGER_CODEC, default="0"),
    Column("grpc_status", "Nullable(UInt16)", INTEGER_CODEC),
    Column("unreadable_reason", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    # Added with gRPC message sizes: the call's request messages and its response messages' payload
    # (token_events counts the response messages). Sizes only, never the payload.
    Column("request_messages", "UInt32", INTEGER_CODEC, default="0"),
    Column("request_message_bytes", "UInt64", INTEGER_CODEC, default="0"),
    Column("response_message_bytes", "UInt64", INTEGER_CODEC, default="0"),
    Column("largest_response_message_bytes", "UInt32", INTEGER_CODEC, default="0"),
    # Added with errors inside streams and the engine's stated queue: the API's label for an error the
    # server sent inside its response (outcome 'error'; a bounded label, never the message), and the
    # engine's own queue time where it states one (vLLM --enable-per-request-metrics).
    Column("error_type", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    Column("engine_queue_ms", "Nullable(Float32)", OPAQUE_CODEC),
    # Added with Kubernetes identity (agent/identity/): the pod and container of the process that served
    # (or, for an outbound row, made) the request, from its cgroup and the container runtime's API.
    # Empty outside containers, and the names while the runtime has not answered yet.
    Column("namespace", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    Column("pod", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    Column("container", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    Column("pod_uid", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    Column("container_id", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
)

REQUESTS = Table(
    "requests", REQUEST_SCHEMA,
    order_by="server_port, req_start, conn_id", partition_by="req_start", ttl_column="req_start",
    settings=DEDUPLICATION_WINDOW_SETTING,
)
REQUESTS_TABLE = REQUESTS.name
REQUEST_COLUMNS: list[str] = REQUESTS.column_names
# name -> ClickHouse type, for writers that must build typed batches without
# asking the store (the sink spools while the store is down).
REQUEST_COLUMN_TYPES: dict[str, str] = {column.name: column.type for column in REQUEST_SCHEMA}

REQUESTS_DDL = REQUESTS.ddl_template

# In an embedded store the materialized views over ``requests`` (rollups,
# ends, figures) read ``requests_for_views`` instead: a table that stores
# nothing (engine Null), and no view reads ``requests`` itself. Each insert
# into a table that a view reads costs chDB's CPU to plan the views, whatever
# the insert holds: about 12 ms for a view that only passes rows on, 60-120 ms
# for the four that write a part each. So the writers feed the views
# themselves: ``Store.insert_arrow`` and ``Store.insert_select`` insert into
# ``requests_for_views`` what they insert into ``requests``, and the agent's
# writer inserts each second's rows into ``requests`` alone and feeds the
# views those of every few seconds in one insert. An insert that goes around
# ``Store`` (raw SQL or HTTP) leaves the views without its rows; most of their
# readers check a view against ``requests`` and compute what it lacks
# (docs/operations.md, "Views in an embedded store", says which do not). A
# ClickHouse server runs the views on its own CPU: there they read ``requests``.
REQUESTS_FOR_VIEWS = REQUESTS.feeding("requests_for_views")
REQUESTS_FOR_VIEWS_TABLE = REQUESTS_FOR_VIEWS.name
# A view older releases made in an embedded store, passing every row inserted into ``requests`` on to
# ``requests_for_views``: dropped by ``Store.ensure_schema``, or the writers' feeds would count rows twice.
RETIRED_EMBEDDED_VIEWS = ("requests_for_views_mv",)

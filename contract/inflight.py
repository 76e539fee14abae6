"""``inflight_samples``: the requests still in flight, sampled by the agent every live-analysis window.

A request's row is written when it ends, so a request that never ends (a
stream that stalled, a queue that never drains) is invisible to every figure
built on ``requests``. The agent therefore samples the exchanges it holds
open, once per window, per server and tenant: how old each is and how far it
got. ``since_progress_ms`` is the time since its last sign of life (its last
text event, else its request's last byte, else its first byte): the figure a
silent stall shows in.
"""

from __future__ import annotations

from .tables import (
    INTEGER_CODEC,
    NULLABLE_TIMESTAMP_TYPE,
    OPAQUE_CODEC,
    SORTED_TIMESTAMP_CODEC,
    TIMESTAMP_CODEC,
    TIMESTAMP_TYPE,
    Column,
    Table,
)

INFLIGHT_SAMPLES_TABLE = "inflight_samples"
# How far a request got when sampled.
RECEIVING, WAITING, STREAMING = "receiving", "waiting", "streaming"

_LABEL = "LowCardinality(String)"

INFLIGHT_SAMPLES = Table(
    INFLIGHT_SAMPLES_TABLE,
    (
        Column("sampled_at", TIMESTAMP_TYPE, SORTED_TIMESTAMP_CODEC),
        Column("node", _LABEL, OPAQUE_CODEC),
        Column("server_port", "UInt16", INTEGER_CODEC),
        Column("role", _LABEL, OPAQUE_CODEC),  # server | client
        Column("tenant", "String", OPAQUE_CODEC),
        Column("model", _LABEL, OPAQUE_CODEC),
        Column("conn_id", "UInt64", INTEGER_CODEC),
        Column("req_seq", "UInt32", INTEGER_CODEC),
        Column("req_start", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
        Column("first_token", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
        Column("stage", _LABEL, OPAQUE_CODEC),  # receiving | waiting (no text yet) | streaming
        Column("token_events", "UInt32", INTEGER_CODEC),  # text events streamed so far
        # Request bytes received so far: the request's size, which its tenant is charged for at once.
        Column("bytes_in", "UInt64", INTEGER_CODEC),
        Column("age_ms", "Float64", OPAQUE_CODEC),  # sampled_at − req_start
        Column("since_progress_ms", "Float64", OPAQUE_CODEC),
    ),
    partition_by="sampled_at", order_by="node, server_port, sampled_at", ttl_column="sampled_at",
)

"""``agent_gaps``: the windows in which a node's agent traced nothing, so that missing rows never read as
a quiet server.

The agent rewrites a heartbeat file every second (agent/heartbeat.py). When it starts and finds the
last one, the time from what the last run could vouch for to the moment its own probes attached is a
window no request was traced in: one row here, and the ``tokenprobe_agent_blind_*`` metrics.
``gap_start`` is the last run's clean stop, or, after a crash, the earliest of its last heartbeat and the
end of what its sink had made durable (rows it held in memory died with it); ``gap_end`` is when this
run's probes attached (the BPF compile of a restart lies inside).
"""

from __future__ import annotations

from .tables import (
    INTEGER_CODEC,
    OPAQUE_CODEC,
    TIMESTAMP_CODEC,
    TIMESTAMP_TYPE,
    Column,
    Table,
)

AGENT_GAPS_TABLE = "agent_gaps"
# Why the agent was blind: its last run stopped cleanly, or ended without a word (SIGKILL, OOM, a crash,
# the node's power): then rows the last run held in memory are lost too.
STOPPED, CRASHED = "stopped", "crashed"

_LABEL = "LowCardinality(String)"

AGENT_GAPS = Table(
    AGENT_GAPS_TABLE,
    (
        Column("gap_start", TIMESTAMP_TYPE, TIMESTAMP_CODEC),  # a few rows a day: no codec is worth more
        Column("gap_end", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
        Column("node", _LABEL, OPAQUE_CODEC),
        Column("reason", _LABEL, OPAQUE_CODEC),  # stopped | crashed
        Column("seconds", "Float64", OPAQUE_CODEC),
        Column("last_pid", "UInt32", INTEGER_CODEC),  # the run that went blind
    ),
    partition_by="gap_start", order_by="node, gap_start", ttl_column="gap_start",
)

"""Writes the generated parts of docs/, or checks that they are current.

- ``docs/schema.md``: every table and materialized view tokenprobe creates, from the one list in
  ``contract/registry.py`` (names, types, defaults, order, keys, TTL), with what each column means.
  The meanings are written here and nowhere else; the names and types only in ``contract/``.
- ``docs/servers.md``: the table between its markers is the server matrix of
  ``tests/server_matrix.py``, the list ``tests/test_kernel_matrix.py`` asserts stack by stack.

    .venv/bin/python scripts/render_docs.py          # rewrite both
    .venv/bin/python scripts/render_docs.py --check  # exit 1 if either is stale (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SCHEMA_PAGE = DOCS / "schema.md"
SERVERS_PAGE = DOCS / "servers.md"

# What each table is for, one line each; every table of the registry needs one.
TABLE_PURPOSE = {
    "agent_gaps": "the windows in which a node's agent traced nothing (stopped, or crashed: then with the rows it "
                  "held in memory), from its heartbeat, written when the next run starts (docs/reliability.md).",
    "requests": "one row per HTTP request the agent saw: the row every figure starts from. Written by the "
                "agent.",
    "gpu_samples": "one row per GPU device per sample, from NVML (`--nvml-hz`) or dcgm-exporter (`--dcgm`).",
    "engine_samples": "one row per scrape of an inference server's own `/metrics` (`--engine`): vLLM, SGLang, "
                      "TGI, llama.cpp.",
    "server_gpus": "which GPU devices a server process (NVML per-process memory) or port (`--gpu PORT=GPU`) "
                   "uses; re-written every minute.",
    "inflight_samples": "the requests still in flight, sampled by the agent every live-analysis window: how "
                        "old each is and how long since it last progressed.",
    "request_split": "one row per analysed inference request: its server TTFT split into queue, prefill and "
                     "overhead, and how (the rest of its phases are its `request_figures` row). A re-analysis of a "
                     "range replaces its rows: read it with `FINAL`.",
    "prefill_calibration": "every prefill-time fit (prefill ≈ intercept + slope × prompt size, on idle "
                           "arrivals), one row per size unit.",
    "knee": "every capacity-knee fit per server and model: the concurrency past which TTFT turns steep.",
    "indicator_matrix": "one cell per server (and GPU), window and indicator. A re-analysed window replaces "
                        "its cells: read it with `FINAL`.",
    "slo_status": "per server, model and objective, compliance and burn rates at one evaluation.",
    "decisions": "every decision the controller took (breaker state or token budget), its evidence and how "
                 "the actuator took it.",
    "request_latency_bands": "served requests per minute, server, model, route, latency metric and band, for "
                             "heatmaps (query with `sum(requests)`); filled by `request_latency_bands_mv`.",
    "request_ttft_by_concurrency": "TTFT digests per minute, server, model and concurrency at arrival, for the "
                                   "knee; filled by `request_ttft_by_concurrency_mv`.",
    "request_ends": "when each inference request ended, sorted by node and end, so a live pass finds the "
                    "requests that ended in its window; filled by `request_ends_mv`.",
    "request_figures": "each inference request's figures that no calibration changes, computed once at "
                       "insert by `request_figures_mv`; a pass only splits the TTFT.",
}

# What each column means. Every column of `requests` needs one; other tables' columns may have one, and
# a meaning that names no column of its table fails the check.
COLUMN_MEANING = {
    "requests": {
        "node": "host name of the node the agent ran on",
        "conn_id": "connection id, unique per node and agent run",
        "req_seq": "0-based index of the request on its connection (keep-alive)",
        "role": "`server` (an accepted connection) or `client` (an outbound one, with `--outbound`)",
        "pid": "process (tgid) that served the connection",
        "comm": "its command name",
        "server_port": "the server's TCP port",
        "client_addr": "the peer's IP address, as text",
        "client_port": "the peer's TCP port",
        "tenant": "value of the tenant header (`--tenant-header`, default `x-tenant-id`, the header the "
                  "actuator's gateway sets): printable ASCII, at most 128 characters, first occurrence; `''` "
                  "if absent or turned off. An identifier, never content",
        "tls": "the connection was TLS, read in plaintext at libssl or Go's crypto/tls",
        "accept_ts": "connection accepted (or connected); NULL if it predates the agent",
        "tls_done_ts": "TLS handshake completed",
        "req_start": "first byte of the request read by the server",
        "req_end": "last byte of the request read",
        "resp_start": "first byte of the response written",
        "first_token": "first event carrying generated output (text, reasoning, a tool call) of choice 0 "
                       "written",
        "last_token": "last such event written",
        "resp_end": "last byte of the response written",
        "method": "HTTP method",
        "path": "request path, query string removed",
        "status": "response status; 0 if none was seen",
        "model": "model named by the response, else by the request body, else `''`",
        "response_id": "the response's `id` (e.g. `chatcmpl-…`), to find it in server logs; `''` if none",
        "streamed": "the response was an event stream: SSE (`text/event-stream`) or NDJSON (Ollama)",
        "token_events": "events that carried generated output (text, reasoning, tool calls) of choice 0 (an "
                        "event may carry several tokens); for gRPC, the response messages",
        "sse_events": "all events of the stream (SSE events or NDJSON lines), role-only, usage and `[DONE]` "
                      "included",
        "token_offsets_us": "each such event's time after `first_token`, in µs",
        "prompt_tokens": "the server's prompt token count, from the stream's `usage` (as its API names it)",
        "completion_tokens": "the server's generated token count (all choices), from `usage`",
        "inflight_at_arrival": "requests in flight on the same server port when this one's first byte arrived",
        "bytes_in": "request bytes on the wire (headers and body)",
        "bytes_out": "response bytes on the wire",
        "body_fp": "keyed hash of the request body (length, first 4 KiB, last 1 KiB), for retry detection; 0 "
                   "if unknown. Never the body; the key never leaves the node",
        "outcome": "`complete`; `client_closed` (the client went away first); `reset`; `truncated` (the "
                   "response did not end: the server closed, the process died, the agent stopped, or the "
                   "connection idled past `--idle-timeout`); `unsupported` (one row for a connection that "
                   "could not be read: see `unreadable_reason`)",
        "error": "why the connection's bytes could not be parsed, or why a row was cut (`no I/O for 600 s: "
                 "…`); `''` if none",
        "api": "the API dialect that read the response: `openai.chat`, `openai.completions`, "
               "`openai.responses`, `anthropic.messages`, `ollama.generate`, `ollama.chat`, `tgi`, `sglang`, "
               "`llamacpp`, `grpc`; `unknown` for an event stream in no known shape (`error` says so); `''` "
               "for other responses (health, metrics)",
        "first_content_token": "first event of choice 0 with visible text (not reasoning or a tool call) "
                               "written",
        "choices": "choices that carried output (`n` > 1); `first_token` and `token_offsets_us` follow choice 0",
        "choice_events": "events that carried output, over all choices (`token_events` when `n` = 1)",
        "engine_prompt_ms": "the engine's own prompt (prefill) time, where its API reports it (Ollama "
                            "`prompt_eval_duration`, llama.cpp `timings.prompt_ms`)",
        "engine_decode_ms": "the engine's own generation time, where reported (Ollama `eval_duration`, "
                            "llama.cpp `timings.predicted_ms`)",
        "capture": "how completely the exchange was seen: `exact`; `gaps` (response bytes, or request bytes "
                   "its framing needed, not captured); `dropped` (the kernel dropped events of its connection "
                   "while it was open). Latency and token figures are exact only on `exact` rows",
        "bytes_unseen": "bytes of the exchange that moved but were not captured (dropped events, capture gaps)",
        "protocol": "`http/1.1`, `h2` (HTTP/2 over TLS) or `h2c` (HTTP/2 in the clear, by prior knowledge or "
                    "after `Upgrade: h2c`: the upgraded request is stream 1); `''` on an unsupported row of "
                    "unknown protocol",
        "stream_id": "the HTTP/2 stream id; 0 for HTTP/1",
        "grpc_status": "gRPC status from the trailers; NULL if not gRPC or not seen",
        "unreadable_reason": "on an `unsupported` row, why: `h2_midstream`, `h2_gap`, `h2_hpack`, "
                             "`h2_protocol`, `h2_limit`, `h2_internal` (HTTP/2 it lost track of), "
                             "`tls_unprobed` (TLS no probe reads), `tls_midstream` (TLS opened before the agent "
                             "that ended before a read bound it), `websocket` / `upgraded` (after a 101 to "
                             "anything but h2c), `unknown_protocol`; `''` otherwise. Its `bytes_in`/`bytes_out` "
                             "are the whole connection's",
        "request_messages": "gRPC: the length-prefixed messages the client sent on the call; 0 if not gRPC",
        "request_message_bytes": "gRPC: their payload bytes (5-byte prefixes excluded)",
        "response_message_bytes": "gRPC: payload bytes of the response messages (`token_events` counts them)",
        "largest_response_message_bytes": "gRPC: the largest response message's payload bytes",
        "error_type": "the API's label for an error the server sent inside its response (`overloaded_error`, …; "
                      "outcome `error`): a bounded label, never the message",
        "engine_queue_ms": "the engine's own queue time for the request, where it states one (vLLM "
                           "`--enable-per-request-metrics`)",
        "namespace": "the Kubernetes namespace of the process's pod (empty outside Kubernetes pods)",
        "pod": "the pod's name, from the container runtime's API (the kubelet's io.kubernetes.* labels)",
        "container": "the container's name in its pod (outside Kubernetes: the runtime's container name)",
        "pod_uid": "the pod's UID, from the process's cgroup (the kubelet's pod cgroup)",
        "container_id": "the container's id, from the process's cgroup (empty outside containers)",
    },
    "gpu_samples": {
        "ts": "when the sample was taken, on the probes' clock",
        "node": "host name of the node",
        "source": "`nvml` or `dcgm`",
        "simulated": "from the reference server's simulated feed: no real GPU",
        "device_id": "GPU UUID, or `UUID/giN` for a MIG instance",
        "gpu_index": "the driver's index of the GPU",
        "mig_profile": "the MIG profile, `''` for a whole GPU",
        "mem_total_bytes": "device memory in all",
        "mem_used_bytes": "device memory in use",
        "mem_free_bytes": "device memory free",
        "mem_reserved_bytes": "device memory the driver reserves",
        "gpu_util_pct": "share of time a kernel ran, %",
        "mem_util_pct": "share of time memory was read or written, %",
        "power_w": "power draw, W",
        "temp_c": "temperature, °C",
        "sm_active": "DCGM profiling: share of SMs active",
        "tensor_active": "DCGM profiling: share of cycles the tensor cores were active",
        "process_pids": "processes holding memory on the device (NVML)",
        "process_mem_bytes": "their memory, in the order of `process_pids`",
        "pod": "dcgm-exporter's `pod` label, where it sets one",
        "extra": "other dcgm-exporter fields, by name",
    },
    "engine_samples": {
        "ts": "when the page was scraped, on the probes' clock",
        "server_url": "the `/metrics` URL scraped",
        "server_port": "the server's port it describes",
        "engine": "`vllm`, `sglang`, `tgi`, `llamacpp` or `unknown`",
        "requests_running": "requests the engine is running",
        "requests_waiting": "requests waiting for a slot",
        "kv_cache_usage": "share of the KV cache in use, 0–1",
        "preemptions_total": "requests preempted so far (a counter)",
        "prompt_tokens_total": "prompt tokens processed so far (a counter)",
        "generation_tokens_total": "tokens generated so far (a counter)",
        "ttft_mean_s": "the engine's own mean TTFT, from its histogram",
        "prefill_mean_s": "the engine's own mean prefill time, where it exports one (vLLM)",
        "raw": "every other series of the page, by name",
    },
    "agent_gaps": {
        "gap_start": "the last run's clean stop, or after a crash the earliest of its last heartbeat and what "
                     "its sink had made durable",
        "gap_end": "when this run's probes attached (a restart's BPF compile lies inside)",
        "node": "the node",
        "reason": "`stopped` or `crashed`",
        "seconds": "gap_end − gap_start",
        "last_pid": "the agent process that went blind",
    },
    "server_gpus": {
        "pid": "the process NVML saw holding memory, walked up to the one that serves HTTP; 0 for a configured "
               "port",
        "server_port": "the configured port (`--gpu PORT=GPU`); 0 for a process NVML saw",
        "source": "`nvml` or `config`",
        "namespace": "the process's pod's namespace (empty for a configured port or outside Kubernetes)",
        "pod": "the process's pod: a GPU's memory named by pod",
        "container": "the process's container in its pod",
    },
    "inflight_samples": {
        "sampled_at": "when the live pass sampled it",
        "role": "`server` or `client`",
        "stage": "`receiving` (request bytes still coming), `waiting` (no text yet) or `streaming`",
        "token_events": "text events streamed so far",
        "bytes_in": "request bytes received so far: what its tenant's prompt is estimated from",
        "age_ms": "`sampled_at − req_start`",
        "since_progress_ms": "time since its last sign of life (last text event, else last request byte): "
                             "what a silent stall shows in",
    },
    "request_split": {
        "node": "the node", "server_port": "the server's port", "req_start": "the request's first byte",
        "conn_id": "the connection (as in `requests`)", "req_seq": "the request's place on its connection",
        "model": "the model",
        "queue_ms": "server TTFT − prefill − overhead, or the engine's stated queue; NULL if not split",
        "prefill_ms": "the engine's stated prefill, else predicted prefill (the calibration), capped at the "
                      "TTFT; NULL if not split",
        "overhead_ms": "server TTFT spent outside the engine (API server, tokenising): the rest of the TTFT "
                       "where the engine states its queue and prefill, else the calibration's",
        "prompt_size": "the size the calibration reads: prompt tokens, else request bytes",
        "prompt_size_source": "`usage` (tokens) or `bytes` (request bytes)",
        "calibration_id": "the prefill calibration that split it; `''`: not split by one",
        "split_method": "`engine` or `engine_prefill` (the engine's stated figures), `calibration`, "
                        "`calibration+engine`, `calibration+engine+overhead`, `poor fit` (the calibration was too "
                        "poor to split with), or `''`",
        "req_end": "the request's last byte (its occupancy's start)",
        "last_token": "the last text event",
        "finished_at": "until when it occupied its server (its last response byte, else the latest it reached)",
        "computed_at": "when this computation ran: the newest replaces older ones (`FINAL`)",
    },
    "prefill_calibration": {
        "calibration_id": "the fit these rows belong to (one row per size unit)",
        "size_unit": "`tokens` (from `usage`) or `bytes` (request size)",
        "method": "the fitting method (Theil–Sen)",
        "intercept_ms": "prefill at size 0",
        "slope_ms": "prefill per token or per byte",
        "r2": "goodness of fit over the inliers",
        "mad_ms": "median absolute residual",
        "n": "idle arrivals fitted",
        "n_outliers": "of them, outliers",
        "data_from": "the first request fitted",
        "data_to": "the last request fitted",
        "engine_scale": "the engine's mean prefill over the predicted mean (vLLM), applied as a factor",
        "engine_prefill_ms": "the engine's own mean prefill over the same span",
        "predicted_prefill_ms": "the fit's mean prediction over the same span",
        "server_overhead_ms": "mean server TTFT − the engine's mean TTFT over the same span: time outside the "
                              "engine",
    },
    "knee": {
        "knee_concurrency": "from the TTFT p50 curve: the last concurrency before the turn; NULL: none found",
        "knee_concurrency_p99": "the same from the TTFT p99 curve",
        "confidence": "0–1, how clearly the curve turns",
        "flat_ttft_ms": "TTFT before the knee",
        "slope_after_ms": "TTFT added per extra request in flight past the knee",
        "max_concurrency_seen": "the highest concurrency at arrival in the data",
        "levels": "concurrency levels with enough requests",
        "n_requests": "requests read",
        "engine_slots": "the engine's own slot count, where its metrics say",
        "explanation": "the fit in words",
    },
    "indicator_matrix": {
        "device_id": "the GPU, `''` for a server-wide cell",
        "indicator": "one of [the indicators](indicators.md#indicators)",
        "value": "the figure judged; NULL: no data",
        "state": "`ok`, `warn`, `crit` or `n/a` (no data)",
        "warn": "the warn threshold",
        "crit": "the crit threshold",
        "comparison": "`above` or `below`: which side of the thresholds is bad",
        "explanation": "the cell in words",
        "computed_at": "when this computation ran: the newest replaces older ones (`FINAL`)",
    },
    "slo_status": {
        "objective": "`ttft`, `tpot`, `e2e` or `goodput`",
        "threshold_ms": "the objective's latency bound",
        "target": "the share of requests that must meet it",
        "requests_5m": "requests counted in the 5-minute window (likewise `_30m`, `_1h`, `_6h`)",
        "good_5m": "of them, those that met the objective",
        "burn_5m": "bad share / (1 − target) over 5 minutes",
        "alert": "`page`, `ticket`, `ok` or `no data`",
    },
    "decisions": {
        "issued_at": "when the controller decided",
        "recorded_at": "when the decision was stored",
        "kind": "`breaker` or `token_budget`",
        "upstream": "the server it targets (`NODE:PORT`); `''` matches every one",
        "model": "the model it targets; `''` matches every one",
        "tenant": "the tenant it targets; `''` matches every one",
        "breaker_state": "`CLOSED`, `OPEN` or `HALF_OPEN` (breakers)",
        "admitted_share": "share admitted while half-open",
        "cooldown_s": "how long the breaker stays open",
        "tokens_per_second": "the budget's rate (token budgets)",
        "burst_tokens": "the budget's bucket size",
        "reason": "why, in words",
        "evidence_name": "the figures acted on, with `evidence_value`, `evidence_threshold` and `evidence_unit`",
        "expires_at": "when it lapses unless renewed",
        "outcome": "`applied`, `refused` or `unreachable`: how the actuator took it",
        "outcome_detail": "the actuator's answer, if not applied",
    },
    "request_latency_bands": {
        "metric": "`ttft`, `tpot`, `e2e`, `itl`, or `all` (every served request)",
        "band": "the latency band, 10 per decade",
        "requests": "requests in the band (for `itl`, inter-token gaps)",
    },
    "request_ttft_by_concurrency": {
        "concurrency": "in flight at arrival + 1",
        "served": "requests served, counted as `request_latency_bands` counts `all`",
        "ttft_ms": "a t-digest of their TTFT: merge with `quantilesTDigestMerge(0.5, 0.99)`",
    },
    "request_ends": {
        "ended_at": "the request's last sign: last byte, else last token, first token, … request start",
    },
    "request_figures": {
        "definition": "a digest of the expressions and thresholds that computed the row",
    },
}

VIEW_PURPOSE = {
    "request_latency_bands_mv": "fills `request_latency_bands` on every insert into `requests`",
    "request_ttft_by_concurrency_mv": "fills `request_ttft_by_concurrency`",
    "request_ends_mv": "fills `request_ends`",
    "request_figures_mv": "fills `request_figures`",
}

SCHEMA_HEADER = """\
<!-- Generated by scripts/render_docs.py from contract/registry.py: do not edit.
     Run `.venv/bin/python scripts/render_docs.py`; tests/test_docs.py fails while this page is stale. -->
# Tables

Every table tokenprobe creates, in the database `tokenprobe` (or the one the store URL names), in the
order the store creates them. The same DDL serves the embedded store (chDB) and a ClickHouse server;
`deploy/clickhouse/cluster.sql` holds it for a cluster. Timestamps are `DateTime64(9, 'UTC')`, wall
clock, NULL where not seen; durations (`*_ms`) are milliseconds. Every table is partitioned by day and
kept 30 days (TTL).

Figures derived from a `requests` row (defined once in `contract/measures.py`, see
[how it measures](measuring.md)): server TTFT = `first_token − req_end`; decode = `last_token −
first_token`; TPOT = decode / (`completion_tokens` − 1), else (`token_events` − 1); network in =
`req_end − req_start`. Only rows with `capture = 'exact'` feed latency figures.

Besides the tables: the view `request_gpu_state` joins each request to the newest GPU and engine sample
at or before its arrival and its first token ([operations](operations.md#gpu-and-engine-state)). In an
embedded store the materialized views read `requests_for_views` (engine Null, same columns as
`requests`), which the store's writers feed.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def schema_page() -> str:
    from tokenprobe.contract import registry

    tables = {table.name: table for table in registry.TABLES}
    missing = sorted(set(tables) - set(TABLE_PURPOSE))
    unknown = sorted(set(TABLE_PURPOSE) - set(tables))
    if missing or unknown:
        raise ValueError(f"TABLE_PURPOSE: tables without a purpose {missing}, purposes of no table {unknown}")
    for name, meanings in COLUMN_MEANING.items():
        stray = sorted(set(meanings) - set(tables[name].column_names))
        if stray:
            raise ValueError(f"COLUMN_MEANING[{name!r}] names columns the table lacks: {stray}")
    undescribed = [column for column in tables["requests"].column_names if column not in COLUMN_MEANING["requests"]]
    if undescribed:
        raise ValueError(f"requests columns without a meaning in COLUMN_MEANING: {undescribed}")
    views = {view.name for view in registry.MATERIALIZED_VIEWS}
    if views != set(VIEW_PURPOSE):
        raise ValueError(f"VIEW_PURPOSE must name exactly the registry's views {sorted(views)}")

    out = [SCHEMA_HEADER, "| table | what it holds |", "|---|---|"]
    out += [f"| [`{name}`](#{name}) | {_cell(TABLE_PURPOSE[name])} |" for name in tables]
    for name, table in tables.items():
        meanings = COLUMN_MEANING.get(name, {})
        out += ["", f"## {name}", "", TABLE_PURPOSE[name][0].upper() + TABLE_PURPOSE[name][1:], "",
                (f"Engine `{table.engine}`, `ORDER BY ({table.order_by})`, "
                 f"`PARTITION BY toDate({table.partition_by})`."), "",
                "| column | type | meaning |", "|---|---|---|"]
        for column in table.columns:
            default = f" (default `{column.default}`)" if column.default is not None else ""
            out.append(f"| `{column.name}` | `{column.type}`{default} | {_cell(meanings.get(column.name, ''))} |")
    out += ["", "## Materialized views", "", "| view | what it does |", "|---|---|"]
    out += [f"| `{view.name}` | {VIEW_PURPOSE[view.name]} |" for view in registry.MATERIALIZED_VIEWS]
    return "\n".join(out) + "\n"


def servers_page(current: str) -> str:
    """``current`` with the text between the server-matrix markers replaced by the matrix's table."""
    from tests.server_matrix import TABLE_BEGIN, TABLE_END, matrix_table

    start, end = current.find(TABLE_BEGIN), current.find(TABLE_END)
    if not 0 <= start < end:
        raise ValueError(f"{SERVERS_PAGE} lacks the markers {TABLE_BEGIN!r} … {TABLE_END!r}")
    return current[:start] + matrix_table() + current[end + len(TABLE_END):]


def rendered() -> dict[Path, str]:
    return {SCHEMA_PAGE: schema_page(), SERVERS_PAGE: servers_page(SERVERS_PAGE.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated page is stale")
    args = parser.parse_args(argv)
    # deploy/render.py writes or checks its own generated files the same way.
    spec = importlib.util.spec_from_file_location("deploy_render", REPO / "deploy" / "render.py")
    deploy_render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deploy_render)
    return deploy_render.write_or_check(rendered(), args.check, ".venv/bin/python scripts/render_docs.py")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # for tests.server_matrix; tokenprobe itself comes from the install
    raise SystemExit(main())

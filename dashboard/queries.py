"""The dashboard's queries: every aggregation runs in ClickHouse; Python receives small results.

``DashboardQueries(store)`` answers each panel with SQL over the store
(embedded chDB through its owner, or a ClickHouse server: the same SQL):

- ``latency_heatmap``: requests counted per time bin × log-spaced latency band
  (``latency``) for TTFT, TPOT or end-to-end latency, inter-token gaps for
  ITL, from the per-minute rollup (``rollup``) where it is complete for the
  window, else by a scan;
- ``phase_breakdown``: per time bin, the mean time a request spent in each
  phase. From the requests' figures and their split (``request_split``,
  written by ``tokenprobe analyze`` and the agent's live analysis) where the split covers the window, else from the raw requests, with queue
  and prefill together as server TTFT;
- ``gpu_usage``: memory used and utilization per GPU per time bin;
- ``indicator_history``: every indicator of every server (and GPU) over the
  window, per time bin the worst of its analysed windows; ``window_requests``:
  the requests of one server in one analysed window (an indicator cell's);
- ``slo_thresholds``: the latency objectives the analysis judged by, else the defaults;
- ``decisions``: the actuator decisions in force during the window;
- ``cell_requests`` / ``request_timeline``: the drill-down, from one heatmap
  cell to its requests (bounded by a limit) and from one request to its events;
- ``recent_traffic``: when the traffic of the last hour that has any began and
  ended, for a window that fits it.

Time bins start at multiples of the bin width since the epoch; the window's
own bounds also apply, so a cell's count is exactly the number of requests
its drill-down finds.

Only requests the traced servers served (``role = 'server'``) are shown; the
outbound legs a gateway opens (``role = 'client'``) would count each request twice.
By default only inference requests (``contract.apis``: a POST to a route that
runs the model): health checks and metrics scrapes (the agent's own among them)
only where ``Filters.inference_only`` is False.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from ..analytics.config import DEFAULT_CONFIG
from ..analytics.scope import Scope, Server
from ..contract import measures
from ..contract.analysis import INDICATOR_MATRIX_TABLE, REQUEST_SPLIT_TABLE, SLO_STATUS_TABLE
from ..contract.apis import inference_request_sql, inference_route_sql
from ..contract.decisions import DECISIONS_TABLE
from ..contract.indicators import CRIT, NO_DATA, OK, WARN
from ..contract.figures import DEFAULT_DEFINITION, REQUEST_FIGURES_TABLE, phases_select
from ..contract.latency import (
    DEFAULT_BANDS_PER_DECADE,
    band_bounds_ms,
    band_sql,
    metric,
)
from ..contract.measures import E2E_MS, TPOT_MS, TTFT_SERVER_MS, ms_between, ns
from ..contract.requests import REQUESTS_TABLE
from ..contract.rollup import (
    ALL_REQUESTS,
    ROLLUP_BANDS_PER_DECADE,
    ROLLUP_STEP_S,
    ROLLUP_TABLE,
)
from ..contract.samples import GPU_SAMPLES_TABLE
from ..store.client import Store

# Bin widths the time axis snaps to, so bin edges fall on round times.
NICE_BIN_SECONDS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
DEFAULT_TARGET_BINS = 120
DEFAULT_CELL_LIMIT = 200
RECENT_TRAFFIC_S = 3600  # how far back from the newest request a fitted window reaches, at most
MIN_FITTED_SPAN_S = 60
SERVER_SQL = "concat(node, ':', toString(server_port))"
STATES_BY_SEVERITY = (NO_DATA, OK, WARN, CRIT)  # a bin of several analysed windows shows its worst


def _bin_start(column: str) -> str:
    """SQL for the epoch second that starts the time bin of a timestamp ({bin_s:UInt32} wide)."""
    return f"intDiv(toUnixTimestamp({column}), {{bin_s:UInt32}}) * {{bin_s:UInt32}}"


def _timestamp(parameter: str) -> str:
    """SQL for a bound integer of epoch nanoseconds as a UTC DateTime64(9)."""
    return f"fromUnixTimestamp64Nano({{{parameter}:Int64}}, 'UTC')"


def _select(columns: Mapping[str, str]) -> str:
    return ",\n    ".join(f"{sql} AS `{name}`" for name, sql in columns.items())


def _epoch_s_to_utc(seconds: pd.Series) -> pd.Series:
    return pd.to_datetime(seconds.astype("int64"), unit="s", utc=True)


def _epoch_ms_to_utc(milliseconds: pd.Series) -> pd.Series:
    return pd.to_datetime(milliseconds.astype("int64"), unit="ms", utc=True)


def choose_bin_seconds(span_s: float, target_bins: int = DEFAULT_TARGET_BINS) -> int:
    """The smallest round bin width that cuts ``span_s`` into at most ``target_bins`` bins."""
    if span_s <= 0 or target_bins < 1:
        raise ValueError("span_s and target_bins must be positive")
    wanted = span_s / target_bins
    return next((width for width in NICE_BIN_SECONDS if width >= wanted), NICE_BIN_SECONDS[-1])


def fitting_span_s(first_ns: int, latest_ns: int, target_bins: int = DEFAULT_TARGET_BINS) -> int:
    """The shortest window, in whole bins of the width it is drawn with, that holds requests started
    from ``first_ns`` to ``latest_ns`` (at least a minute of them) once its end is rounded up to a
    whole bin after the latest: the traffic fills the heatmap instead of a sliver of it."""
    traffic_s = max((latest_ns - first_ns) / 1e9, MIN_FITTED_SPAN_S)
    # One bin more than the traffic needs: rounding the end up may push the start past the first request.
    return next((math.ceil(traffic_s / width) + 1) * width for width in NICE_BIN_SECONDS
                if math.ceil(traffic_s / width) + 1 <= target_bins)


@dataclass(frozen=True)
class Filters:
    """The time window [start_ns, end_ns) and, where not empty, the servers, models and routes kept.

    A server is written ``node:port`` (as ``DashboardQueries.filter_options`` lists them).
    """

    start_ns: int
    end_ns: int
    servers: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    routes: tuple[str, ...] = ()
    # Only calls that run a model (contract.apis); False adds health checks, metrics scrapes and the like.
    inference_only: bool = True

    def __post_init__(self):
        if self.end_ns <= self.start_ns:
            raise ValueError("the time window is empty: end must be after start")

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes the server filter names (empty: all)."""
        return tuple(sorted({server.rpartition(":")[0] for server in self.servers}))

    def window_parameters(self) -> dict:
        return {"window_start_ns": self.start_ns, "window_end_ns": self.end_ns}

    def conditions(self, time_column: str, *, models: bool = True, routes: bool = True,
                   end_column: str | None = None) -> tuple[str, dict]:
        """A WHERE clause keeping rows whose ``time_column`` is in the window (with ``end_column``: whose
        span from ``time_column`` to ``end_column`` overlaps it) and whose server, model (if ``models``)
        and route (if ``routes``) pass the filters, with its bound parameters. For tables with the
        requests' ``node``, ``server_port``, ``model`` and ``path`` columns."""
        after_start = f"{end_column} >" if end_column else f"{time_column} >="
        conditions = [f"{after_start} {_timestamp('window_start_ns')}",
                      f"{time_column} < {_timestamp('window_end_ns')}"]
        parameters = self.window_parameters()
        scope = Scope(tuple(Server.parse(server) for server in self.servers), self.models)
        scope_condition, scope_parameters = scope.condition(with_model=models)
        conditions.append(scope_condition)
        parameters.update(scope_parameters)
        if routes and self.routes:
            conditions.append("path IN {routes:Array(String)}")
            parameters["routes"] = list(self.routes)
        return " AND ".join(conditions), parameters

    def request_conditions(self) -> tuple[str, dict]:
        """The WHERE clause for the requests table: served requests that started in the window."""
        where, parameters = self.conditions("req_start")
        inference = f" AND {inference_request_sql()}" if self.inference_only else ""
        return f"role = 'server' AND {where}{inference}", parameters

    def rollup_conditions(self) -> tuple[str, dict]:
        """The WHERE clause for the rollup's minutes. It keeps routes but no method: inference-only keeps
        the inference routes, which ``DashboardQueries.heatmap_source`` checks against the requests."""
        where, parameters = self.conditions("minute")
        inference = f" AND {inference_route_sql()}" if self.inference_only else ""
        return f"{where}{inference}", parameters


class DashboardQueries:
    """The panels' queries over one store. Errors from the store propagate (StoreUnavailable, DatabaseError)."""

    def __init__(self, store: Store):
        self.store = store
        # Whether the rollup counts every request of a window, asked once per window per instance.
        self._rollup_complete: dict[Filters, bool] = {}

    def _frame(self, columns: Mapping[str, str], rest: str, parameters: Mapping) -> pd.DataFrame:
        """``SELECT columns rest`` as a DataFrame that has its columns even when no row matched."""
        frame = self.store.query_df(f"SELECT\n    {_select(columns)}\n{rest}", parameters)
        return frame if not frame.empty else pd.DataFrame(columns=list(columns))

    # -- what the store holds ---------------------------------------------------

    def has_table(self, table: str) -> bool:
        return bool(self.store.query_rows(
            "SELECT 1 FROM system.tables WHERE database = {database:String} AND name = {table:String}",
            {"database": self.store.database, "table": table},
        ))

    def has_rows(self, table: str, time_column: str, filters: Filters) -> bool:
        """Whether the table exists and has a row whose ``time_column`` lies in the window."""
        if not self.has_table(table):
            return False
        return bool(self.store.query_rows(
            f"SELECT 1 FROM {self.store.table(table)} WHERE {time_column} >= {_timestamp('window_start_ns')}"
            f" AND {time_column} < {_timestamp('window_end_ns')} LIMIT 1",
            filters.window_parameters(),
        ))

    def latest_request_ns(self) -> int | None:
        """When the newest served request started (epoch ns), or None if there is none (or no table)."""
        if not self.has_table(REQUESTS_TABLE):
            return None
        ((latest,),) = self.store.query_rows(
            f"SELECT if(count() = 0, NULL, {ns('max(req_start)')})"
            f" FROM {self.store.table(REQUESTS_TABLE)} WHERE role = 'server'"
        )
        return latest

    def recent_traffic(self) -> tuple[int, int] | None:
        """(first, newest) start in epoch ns of the served requests of the last hour before the newest
        one, or None if there is none: a store a finished run left (the demo's) has a minute, a live one
        an hour; requests older than that are not what a newcomer looks for first."""
        latest = self.latest_request_ns()
        if latest is None:
            return None
        ((earliest,),) = self.store.query_rows(
            f"SELECT {ns('min(req_start)')} FROM {self.store.table(REQUESTS_TABLE)}"
            f" WHERE role = 'server' AND req_start >= {_timestamp('since_ns')}",
            {"since_ns": latest - RECENT_TRAFFIC_S * 1_000_000_000})
        return earliest, latest

    def filter_options(self, filters: Filters) -> dict[str, list[str]]:
        """The servers (``node:port``), models and routes seen in the window, ignoring the other filters."""
        window = Filters(filters.start_ns, filters.end_ns, inference_only=filters.inference_only)
        if self.heatmap_source(window, ROLLUP_STEP_S) == "rollup":  # far fewer rows, the same labels
            where, parameters = window.rollup_conditions()
            source = f"{self.store.table(ROLLUP_TABLE)} WHERE metric = {{all:String}} AND {where}"
            parameters["all"] = ALL_REQUESTS
        else:
            where, parameters = window.request_conditions()
            source = f"{self.store.table(REQUESTS_TABLE)} WHERE {where}"
        ((servers, models, routes),) = self.store.query_rows(
            f"SELECT arraySort(groupUniqArray(1000)({SERVER_SQL})),"
            f" arraySort(groupUniqArray(1000)(model)), arraySort(groupUniqArray(1000)(path)) FROM {source}",
            parameters,
        )
        return {"servers": list(servers), "models": list(models), "routes": list(routes)}

    # -- heatmaps and their drill-down ------------------------------------------------

    def heatmap_source(self, filters: Filters, bin_s: int, bands_per_decade: int = DEFAULT_BANDS_PER_DECADE,
                       metric_key: str | None = None) -> str:
        """Where a heatmap over ``filters`` comes from: "rollup" (the per-minute rollup, when its bins
        and bands fit and it counts every request of the window) or "requests" (a scan).

        With ``metric_key`` the rollup must count every sample of that metric in the window: minutes
        rolled up by an older view lack the metrics added since (ITL) though they count every request.
        Inference-only, it must count what the requests do: a call to an inference route that is not a
        POST (the rollup keeps no method) sends the window to a scan.
        """
        step_ns = ROLLUP_STEP_S * 1_000_000_000
        fits = (bands_per_decade == ROLLUP_BANDS_PER_DECADE and bin_s % ROLLUP_STEP_S == 0
                and filters.start_ns % step_ns == 0 and filters.end_ns % step_ns == 0)
        if not fits or not self.has_table(ROLLUP_TABLE):
            return "requests"
        if (filters, metric_key) not in self._rollup_complete:
            if metric_key is None:
                samples, rolled_metric = "1", ALL_REQUESTS
            else:
                chosen = metric(metric_key)
                samples = f"length({chosen.sql})" if chosen.per_gap else f"toUInt8({chosen.condition})"
                rolled_metric = chosen.key
            where, parameters = filters.request_conditions()
            ((requests,),) = self.store.query_rows(
                f"SELECT sum({samples}) FROM {self.store.table(REQUESTS_TABLE)} WHERE {where}", parameters)
            rolled_where, rolled_parameters = filters.rollup_conditions()
            ((rolled,),) = self.store.query_rows(
                f"SELECT sum(requests) FROM {self.store.table(ROLLUP_TABLE)}"
                f" WHERE metric = {{metric:String}} AND {rolled_where}",
                {**rolled_parameters, "metric": rolled_metric})
            self._rollup_complete[(filters, metric_key)] = requests == rolled
        return "rollup" if self._rollup_complete[(filters, metric_key)] else "requests"

    def latency_heatmap(self, metric_key: str, filters: Filters, bin_s: int,
                        bands_per_decade: int = DEFAULT_BANDS_PER_DECADE, source: str | None = None) -> pd.DataFrame:
        """One row per non-empty cell: bin_start_s, band, requests, time_bin, time_bin_end, low_ms, high_ms.

        ``source`` forces "requests" (a scan) or "rollup" (only valid where ``heatmap_source`` allows
        it); by default ``heatmap_source`` chooses.
        """
        source = source or self.heatmap_source(filters, bin_s, bands_per_decade, metric_key)
        if source not in ("rollup", "requests"):
            raise ValueError(f"unknown heatmap source {source!r}: 'rollup' or 'requests'")
        if source == "rollup":
            frame = self._heatmap_from_rollup(metric_key, filters, bin_s)
        else:
            frame = self._heatmap_from_requests(metric_key, filters, bin_s, bands_per_decade)
        frame["time_bin"] = _epoch_s_to_utc(frame["bin_start_s"])
        frame["time_bin_end"] = _epoch_s_to_utc(frame["bin_start_s"] + bin_s)
        frame["low_ms"], frame["high_ms"] = band_bounds_ms(frame["band"].astype("int64"), bands_per_decade)
        return frame

    def _heatmap_from_requests(self, metric_key: str, filters: Filters, bin_s: int,
                               bands_per_decade: int) -> pd.DataFrame:
        chosen = metric(metric_key)
        where, parameters = filters.request_conditions()
        # A per-gap metric counts each gap of a request in its own band.
        band, gaps = ("gap_band", f"ARRAY JOIN {chosen.bands_sql('{bands:UInt32}')} AS gap_band\n") \
            if chosen.per_gap else (band_sql(chosen.sql, "{bands:UInt32}"), "")
        return self._frame(
            {"bin_start_s": _bin_start("req_start"), "band": band, "requests": "count()"},
            f"""FROM {self.store.table(REQUESTS_TABLE)}
{gaps}WHERE {where} AND {chosen.condition}
GROUP BY bin_start_s, band
ORDER BY bin_start_s, band""",
            {**parameters, "bin_s": bin_s, "bands": bands_per_decade},
        )

    def _heatmap_from_rollup(self, metric_key: str, filters: Filters, bin_s: int) -> pd.DataFrame:
        where, parameters = filters.rollup_conditions()
        return self._frame(
            {"bin_start_s": _bin_start("minute"), "band": "toInt32(band)", "requests": "sum(requests)"},
            f"""FROM {self.store.table(ROLLUP_TABLE)}
WHERE metric = {{metric:String}} AND {where}
GROUP BY bin_start_s, band
ORDER BY bin_start_s, band""",
            {**parameters, "bin_s": bin_s, "metric": metric(metric_key).key},
        )

    def cell_requests(self, metric_key: str, filters: Filters, bin_start_s: int, bin_s: int, band: int,
                      bands_per_decade: int = DEFAULT_BANDS_PER_DECADE,
                      limit: int = DEFAULT_CELL_LIMIT) -> pd.DataFrame:
        """The requests of one heatmap cell, slowest first, at most ``limit`` of them; ``in_cell`` is how
        many of the cell's samples each holds (1, or for ITL its gaps in the band, ``latency_ms`` the
        slowest of them)."""
        chosen = metric(metric_key)
        where, parameters = filters.request_conditions()
        if chosen.per_gap:
            in_band = f"gap_ms -> {band_sql('gap_ms', '{bands:UInt32}')} = {{band:Int32}}"
            latency, in_cell = f"arrayMax(arrayFilter({in_band}, {chosen.sql}))", f"arrayCount({in_band}, {chosen.sql})"
            cell_condition = f"{in_cell} > 0"
        else:
            latency, in_cell = chosen.sql, "1"
            cell_condition = f"{band_sql(chosen.sql, '{bands:UInt32}')} = {{band:Int32}}"
        return self._frame(
            {"req_start_ns": ns("req_start"), "req_start_ms": "toUnixTimestamp64Milli(req_start)",
             "server": SERVER_SQL, "model": "model", "route": "path", "status": "status", "outcome": "outcome",
             "token_events": "token_events", "latency_ms": latency, "in_cell": in_cell, "node": "node",
             "server_port": "server_port", "conn_id": "conn_id", "req_seq": "req_seq",
             "response_id": "response_id"},
            f"""FROM {self.store.table(REQUESTS_TABLE)}
WHERE {where}
    AND req_start >= fromUnixTimestamp64Nano({{cell_start_s:Int64}} * 1000000000, 'UTC')
    AND req_start < fromUnixTimestamp64Nano({{cell_end_s:Int64}} * 1000000000, 'UTC')
    AND {chosen.condition}
    AND {cell_condition}
ORDER BY latency_ms DESC
LIMIT {{limit:UInt32}}""",
            {**parameters, "cell_start_s": bin_start_s, "cell_end_s": bin_start_s + bin_s,
             "bands": bands_per_decade, "band": band, "limit": limit},
        )

    def request_timeline(self, node: str, server_port: int, conn_id: int, req_seq: int,
                         req_start_ns: int) -> pd.DataFrame:
        """One request's events in time order, as ms after its first byte: event, at_ms, kind.

        Kinds: ``connection`` (accept, TLS handshake: a connection's first
        request only), ``request`` (first and last byte in), ``phase`` (end of
        queue and of prefill, once ``tokenprobe analyze`` has split them),
        ``token`` (every generated-text event), ``response`` (first and last
        byte out). Empty if the store no longer has the request.
        """
        key = {"node": node, "server_port": server_port, "conn_id": conn_id, "req_seq": req_seq,
               "req_start_ns": req_start_ns}
        key_condition = ("node = {node:String} AND server_port = {server_port:UInt16}"
                         f" AND req_start = {_timestamp('req_start_ns')}"
                         " AND conn_id = {conn_id:UInt64} AND req_seq = {req_seq:UInt32}")
        moments = ("accept_ts", "tls_done_ts", "req_start", "req_end", "resp_start", "first_token", "resp_end")
        found = self._frame(
            {**{f"{moment}_ms": ms_between("req_start", moment) for moment in moments},
             "token_offsets_us": "token_offsets_us", "outcome": "outcome"},
            f"FROM {self.store.table(REQUESTS_TABLE)} WHERE {key_condition} LIMIT 1",
            key,
        )
        if found.empty:
            return pd.DataFrame(columns=["event", "at_ms", "kind"])
        request = found.iloc[0]
        events = []
        if req_seq == 0:  # accept and handshake belong to the connection's first request
            events += [("accept", request["accept_ts_ms"], "connection"),
                       ("TLS handshake done", request["tls_done_ts_ms"], "connection")]
        events += [("request first byte in", request["req_start_ms"], "request"),
                   ("request last byte in", request["req_end_ms"], "request")]
        events += self._phase_events(key_condition, key, request["req_end_ms"])
        events.append(("response first byte out", request["resp_start_ms"], "response"))
        if not pd.isna(request["first_token_ms"]):
            events += [(f"token event {index + 1}", request["first_token_ms"] + offset_us / 1000.0, "token")
                       for index, offset_us in enumerate(request["token_offsets_us"])]
        events.append((f"response last byte out ({request['outcome']})", request["resp_end_ms"], "response"))
        timeline = pd.DataFrame(events, columns=["event", "at_ms", "kind"]).dropna(subset=["at_ms"])
        return timeline.sort_values("at_ms", kind="stable").reset_index(drop=True)

    def _phase_events(self, key_condition: str, key: Mapping, req_end_ms: float) -> list[tuple]:
        """The end of queue and of prefill, from analytics' split of this request, when it has one."""
        if pd.isna(req_end_ms) or not self.has_table(REQUEST_SPLIT_TABLE):
            return []
        rows = self.store.query_rows(
            f"SELECT queue_ms, prefill_ms FROM {self.store.table(REQUEST_SPLIT_TABLE)} FINAL"
            f" WHERE {key_condition} AND calibration_id != '' LIMIT 1",
            key,
        )
        if not rows or None in rows[0]:
            return []
        queue_ms, prefill_ms = rows[0]
        return [("queue end (prefill starts)", req_end_ms + queue_ms, "phase"),
                ("prefill end", req_end_ms + queue_ms + prefill_ms, "phase")]

    # -- panels over time ------------------------------------------------------------

    def phase_breakdown(self, filters: Filters, bin_s: int) -> tuple[pd.DataFrame, bool]:
        """Per time bin and phase, the mean ms a request spent in it (time_bin, phase, mean_ms), and
        whether the figures come from analytics' split (queue and prefill).

        Each phase's total is divided by all the bin's requests, so the phases
        stack up to the mean end-to-end time. Where the split is there, requests
        whose queue and prefill could not be split count as "server TTFT".
        """
        analysed = self.has_rows(REQUEST_SPLIT_TABLE, "req_start", filters)
        if analysed:
            where, parameters = filters.conditions("req_start")
            split_where, _ = filters.conditions("req_start", routes=False)  # the split has no route
            source = "({})".format(phases_select(self.store.table(REQUEST_FIGURES_TABLE),
                                                 self.store.table(REQUEST_SPLIT_TABLE), where, DEFAULT_DEFINITION,
                                                 split_where))
            split = "calibration_id != ''"
            phases = {"network in": "network_in_ms", "queue": f"if({split}, queue_ms, NULL)",
                      "prefill": f"if({split}, prefill_ms, NULL)",
                      "server TTFT": f"if({split}, NULL, ttft_server_ms)", "decode": "decode_ms",
                      "response tail": "network_out_ms"}
        else:
            where, parameters = filters.request_conditions()
            source = f"{self.store.table(REQUESTS_TABLE)} WHERE {where}"
            phases = {"network in": measures.NETWORK_IN_MS, "server TTFT": measures.TTFT_SERVER_MS,
                      "decode": measures.DECODE_MS, "response tail": measures.NETWORK_OUT_MS}
        frame = self._frame(
            {"bin_start_s": _bin_start("req_start"),
             **{phase: f"sum(ifNull({sql}, 0)) / count()" for phase, sql in phases.items()}},
            f"FROM {source} GROUP BY bin_start_s ORDER BY bin_start_s",
            {**parameters, "bin_s": bin_s},
        )
        frame["time_bin"] = _epoch_s_to_utc(frame["bin_start_s"])
        long = frame.melt(id_vars=["time_bin"], value_vars=list(phases), var_name="phase", value_name="mean_ms")
        return long, analysed

    def gpu_usage(self, filters: Filters, bin_s: int) -> pd.DataFrame:
        """Per GPU and time bin: mean memory used and total (GiB), mean utilization (%), and whether the
        samples were simulated. Only the GPUs of the filtered servers' nodes, when servers are filtered."""
        node_condition = " AND node IN {nodes:Array(String)}" if filters.nodes else ""
        frame = self._frame(
            {"bin_start_s": _bin_start("ts"),
             "gpu": "concat(node, ' GPU ', ifNull(toString(gpu_index), device_id))",
             "mem_used_gib": "avg(mem_used_bytes) / 1073741824",
             "mem_total_gib": "max(mem_total_bytes) / 1073741824",
             "gpu_util_pct": "avg(gpu_util_pct)",
             "simulated": "max(simulated)"},
            f"""FROM {self.store.table(GPU_SAMPLES_TABLE)}
WHERE ts >= {_timestamp('window_start_ns')} AND ts < {_timestamp('window_end_ns')}{node_condition}
GROUP BY bin_start_s, gpu
ORDER BY gpu, bin_start_s""",
            {**filters.window_parameters(), "bin_s": bin_s, "nodes": list(filters.nodes)},
        )
        frame["time_bin"] = _epoch_s_to_utc(frame["bin_start_s"])
        return frame

    def window_requests(self, node: str, server_port: int, start_ns: int, end_ns: int,
                        limit: int = DEFAULT_CELL_LIMIT, inference_only: bool = True) -> pd.DataFrame:
        """The requests one server served that started in [start_ns, end_ns) (an indicator cell's window),
        slowest end to end first, at most ``limit``: started, model, route, status, outcome, TTFT, TPOT
        and end-to-end ms, token_events, response_id, and ``in_window`` (how many there are in all)."""
        window = Filters(start_ns, end_ns, (f"{node}:{server_port}",), inference_only=inference_only)
        where, parameters = window.request_conditions()
        frame = self._frame(
            {"req_start_ms": "toUnixTimestamp64Milli(req_start)", "model": "model", "route": "path",
             "status": "status", "outcome": "outcome", "ttft_ms": TTFT_SERVER_MS, "tpot_ms": TPOT_MS,
             "e2e_ms": E2E_MS, "token_events": "token_events", "response_id": "response_id",
             "in_window": "count() OVER ()"},
            f"""FROM {self.store.table(REQUESTS_TABLE)}
WHERE {where}
ORDER BY e2e_ms DESC NULLS FIRST
LIMIT {{limit:UInt32}}""",
            {**parameters, "limit": limit},
        )
        frame.insert(0, "started (UTC)", _epoch_ms_to_utc(frame.pop("req_start_ms")))
        return frame

    def decisions(self, filters: Filters, limit: int = 1000) -> pd.DataFrame:
        """The actuator decisions in force at some point of the window (for any model, or a filtered
        one), oldest first: target, action, kind, outcome, reason, decision_id, tokens_per_second (a
        budget's), breaker_state (a breaker's), issued_at, expires_at."""
        model_condition = " AND (model = '' OR model IN {models:Array(String)})" if filters.models else ""
        frame = self._frame(
            {"issued_at_ms": "toUnixTimestamp64Milli(issued_at)",
             "expires_at_ms": "toUnixTimestamp64Milli(expires_at)",
             "target": "arrayStringConcat(arrayFilter(part -> part != '', ["
                       "if(upstream = '', '', concat('upstream=', upstream)),"
                       " if(model = '', '', concat('model=', model)),"
                       " if(tenant = '', '', concat('tenant=', tenant))]), ',')",
             "action": "if(kind = 'breaker', concat('breaker ', breaker_state),"
                       " concat('budget ', toString(round(tokens_per_second, 1)), ' tok/s'))",
             "kind": "kind", "outcome": "outcome", "reason": "reason", "decision_id": "decision_id",
             "tokens_per_second": "if(kind = 'breaker', NULL, tokens_per_second)",
             "breaker_state": "if(kind = 'breaker', breaker_state, '')"},
            f"""FROM {self.store.table(DECISIONS_TABLE)}
WHERE issued_at < {_timestamp('window_end_ns')} AND expires_at > {_timestamp('window_start_ns')}{model_condition}
ORDER BY issued_at
LIMIT {{limit:UInt32}}""",
            {**filters.window_parameters(), "models": list(filters.models), "limit": limit},
        )
        frame["issued_at"] = _epoch_ms_to_utc(frame.pop("issued_at_ms"))
        frame["expires_at"] = _epoch_ms_to_utc(frame.pop("expires_at_ms"))
        frame["target"] = frame["target"].replace("", "everything")
        return frame

    def indicator_history(self, filters: Filters, bin_s: int) -> pd.DataFrame:
        """Every indicator of every server (and GPU) over the window, one row per time bin (by the start
        of the analysed windows in it) showing the bin's worst window: server, node, server_port,
        device_id, indicator, state, value, unit, explanation, window_start_ns and window_end_ns (that
        window's), windows, warn_windows, crit_windows (how many the bin holds), and its extent
        from and to (UTC, the first window's start to the last one's end)."""
        where, parameters = filters.conditions("window_start", models=False, routes=False, end_column="window_end")
        severities = ", ".join(f"'{state}'" for state in STATES_BY_SEVERITY)
        worst = f"(indexOf([{severities}], state), window_end)"  # the latest of the worst windows
        frame = self._frame(
            {"server": SERVER_SQL, "node": "node", "server_port": "server_port", "device_id": "device_id",
             "indicator": "indicator", "bin_start_s": _bin_start("window_start"),
             # Named apart from the columns they aggregate, which ``worst`` reads.
             "worst_state": f"argMax(state, {worst})", "worst_value": f"argMax(value, {worst})",
             "unit": "any(unit)", "worst_explanation": f"argMax(explanation, {worst})",
             "window_start_ns": f"argMax({ns('window_start')}, {worst})",
             "window_end_ns": f"argMax({ns('window_end')}, {worst})",
             "windows": "count()", "warn_windows": f"countIf(state = '{WARN}')",
             "crit_windows": f"countIf(state = '{CRIT}')",
             "from_ms": "toUnixTimestamp64Milli(min(window_start))", "to_ms": "toUnixTimestamp64Milli(max(window_end))"},
            f"""FROM {self.store.table(INDICATOR_MATRIX_TABLE)} FINAL
WHERE {where}
GROUP BY server, node, server_port, device_id, indicator, bin_start_s
ORDER BY server, device_id, indicator, bin_start_s""",
            {**parameters, "bin_s": bin_s},
        )
        frame["from"] = _epoch_ms_to_utc(frame.pop("from_ms"))
        frame["to"] = _epoch_ms_to_utc(frame.pop("to_ms"))
        return frame.rename(columns={"worst_state": "state", "worst_value": "value",
                                     "worst_explanation": "explanation"})

    def slo_thresholds(self, filters: Filters) -> pd.DataFrame:
        """The latency objectives the analysis judged the window's servers by (``slo_status``: the latest
        evaluation per server, model and objective), else the analytics' defaults: objective, threshold_ms,
        target, and source ("store" or "default"). One row per distinct objective, threshold and target."""
        stored = pd.DataFrame(columns=["objective", "threshold_ms", "target"])
        if self.has_table(SLO_STATUS_TABLE):
            where, parameters = filters.conditions("evaluated_at", routes=False)
            stored = self._frame(
                {"objective": "objective", "threshold_ms": "latest_threshold_ms", "target": "latest_target"},
                f"""FROM (
    SELECT objective, argMax(threshold_ms, evaluated_at) AS latest_threshold_ms,
        argMax(target, evaluated_at) AS latest_target
    FROM {self.store.table(SLO_STATUS_TABLE)}
    WHERE {where} AND threshold_ms IS NOT NULL
    GROUP BY node, server_port, model, objective)
GROUP BY objective, latest_threshold_ms, latest_target
ORDER BY objective, latest_threshold_ms""",
                parameters,
            )
        defaults = pd.DataFrame([(objective.objective, objective.threshold_ms, objective.target)
                                 for objective in DEFAULT_CONFIG.objectives
                                 if objective.objective not in set(stored["objective"])],
                                columns=["objective", "threshold_ms", "target"])
        return pd.concat([stored.assign(source="store"), defaults.assign(source="default")], ignore_index=True)

"""request_figures: the phases' calibration-independent figures, computed when a request is stored.

A pass reads them instead of computing them from ``requests``, and readers join them with the split it
stores; the phases read must be the ones computed from ``requests`` to the bit, in a store
made before the table existed too, with rows missing from it, and with other
thresholds than the ones the view computes with.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import pytest
from tokenprobe.analytics.config import DEFAULT_CONFIG, AnalyticsConfig
from tokenprobe.analytics.pipeline import analyze
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange
from tokenprobe.contract import measures
from tokenprobe.contract.analysis import REQUEST_PHASES_COLUMNS
from tokenprobe.contract.figures import (
    DEFAULT_LONG_STREAM_EVENTS,
    REQUEST_FIGURES_TABLE,
    REQUEST_FIGURES_VIEW,
    figures_definition,
)
from tokenprobe.store.embedded import open_store

from tests.support.phases import phases_of
from tests.support.slot_simulation import LoadPhase, SlotServer, simulate

MINUTE = 60 * NS_PER_S
END_NS = (time.time_ns() // MINUTE - 1) * MINUTE
START_NS = END_NS - 4 * MINUTE
ANALYSED = TimeRange(START_NS, END_NS)
# Every column but when it was computed and the calibration's id (a new one every fit).
PHASE_COLUMNS = ", ".join(column.name for column in REQUEST_PHASES_COLUMNS
                          if column.name not in ("computed_at", "calibration_id"))
KEY = "node, server_port, req_start, conn_id, req_seq"


def request_rows() -> list[dict]:
    """Light then heavy load (idle arrivals to calibrate on, queueing after), every other stream with a stall."""
    requests = simulate(SlotServer(), [LoadPhase(120, 2.0), LoadPhase(120, 20.0)], start_ns=START_NS, seed=11)
    rows = []
    for index, request in enumerate(requests):
        row = request.row
        offsets = row["token_offsets_us"]
        if index % 2 and len(offsets) > 4:  # one gap 6x the others: a stall at factor 5 and at 3
            stall_at = len(offsets) // 2
            offsets = [*offsets[:stall_at], *(offset + 5 * (offsets[1] - offsets[0]) for offset in offsets[stall_at:])]
        rows.append({**row, "token_offsets_us": offsets})
    return rows


def phases(store) -> list[tuple]:
    return store.query_rows(f"SELECT {PHASE_COLUMNS} FROM {phases_of(store)} ORDER BY {KEY}")


def figures_count(store) -> int:
    return store.query_rows(f"SELECT count() FROM {store.table(REQUEST_FIGURES_TABLE)}")[0][0]


@pytest.fixture(scope="module")
def rows():
    return request_rows()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, rows):
    """A store made by this tokenprobe, the view writing every request's figures as it is stored, and its
    phases. (chDB opens one directory a process: every test here uses this store.)"""
    store = open_store(f"chdb://{tmp_path_factory.mktemp('figures') / 'store'}")
    store.ensure_schema()
    store.insert_rows("requests", rows)
    analyze(store, ANALYSED, window_s=60, now_ns=next(PASS_TIMES))
    yield store, phases(store)
    store.close()


# Each pass later than the one before: its phases replace the earlier pass's.
PASS_TIMES = itertools.count(END_NS)


def restore_from_scratch(store, rows) -> None:
    """The store as an older tokenprobe left it: the requests stored, no figures table nor view, no phases."""
    store.command(f"DROP VIEW {store.table(REQUEST_FIGURES_VIEW)}")
    store.command(f"DROP TABLE {store.table(REQUEST_FIGURES_TABLE)}")
    for table in ("requests", "request_split"):
        store.command(f"TRUNCATE TABLE {store.table(table)}")
    store.insert_rows("requests", rows)


def test_every_stored_request_has_its_figures_and_the_pass_reads_them(reference, rows):
    store, expected = reference
    assert figures_count(store) == len(rows) == len(expected)
    assert any(row[PHASE_COLUMNS.split(", ").index("queue_ms")] is not None for row in expected)  # split
    # The phases are the stored figures with their split: a changed stored figure shows in them, and a pass
    # splits from them (a TTFT a second longer is a second more queue).
    store.command(f"ALTER TABLE {store.table(REQUEST_FIGURES_TABLE)} UPDATE tls_ms = 1234.5,"
                  " first_token = first_token + toIntervalSecond(1) WHERE 1 SETTINGS mutations_sync = 2")
    before = [row[PHASE_COLUMNS.split(", ").index("queue_ms")] for row in expected]
    report = analyze(store, ANALYSED, window_s=60, now_ns=next(PASS_TIMES))
    assert {tls for (tls,) in store.query_rows(f"SELECT tls_ms FROM {phases_of(store)}")} == {1234.5}
    after = [queue for (queue,) in store.query_rows(f"SELECT queue_ms FROM {phases_of(store)} ORDER BY {KEY}")]
    added = [new - old for new, old in zip(after, before, strict=True) if old is not None]
    assert report.calibrations and added and all(0 < ms <= 1000.01 for ms in added)
    assert sum(ms > 999.99 for ms in added) > len(added) / 2  # prefill, where below its TTFT, stays


def test_a_store_made_before_the_figures_is_back_filled_and_analyses_the_same(reference, rows):
    store, expected = reference
    restore_from_scratch(store, rows)
    analyze(store, ANALYSED, window_s=60, now_ns=next(PASS_TIMES))  # its ensure_schema back-fills
    assert figures_count(store) == len(rows)
    assert phases(store) == expected


@pytest.mark.parametrize("damage", [
    "DELETE WHERE conn_id % 3 = 0",  # rows stored while the view was being replaced
    "UPDATE definition = 'older' WHERE conn_id % 3 = 0",  # rows an older or otherwise configured view wrote
])
def test_figures_missing_or_computed_otherwise_are_computed_from_the_requests(reference, rows, damage):
    store, expected = reference
    restore_from_scratch(store, rows)
    store.ensure_schema()
    store.command(f"ALTER TABLE {store.table(REQUEST_FIGURES_TABLE)} {damage} SETTINGS mutations_sync = 2")
    if damage.startswith("DELETE"):
        # and one stored twice (a replay the view did not deduplicate): as wrong as one missing
        store.command(f"INSERT INTO {store.table(REQUEST_FIGURES_TABLE)}"
                      f" SELECT * FROM {store.table(REQUEST_FIGURES_TABLE)} LIMIT 1")
    analyze(store, ANALYSED, window_s=60, now_ns=next(PASS_TIMES))
    assert phases(store) == expected


def expected_stalls(row: dict, factor: float) -> int:
    """measures.stall_count for one row: gaps over ``factor`` × the stream's median gap (its middle element)."""
    gaps = measures.itl_gaps_ms(row)
    median = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    return sum(gap > factor * median for gap in gaps)


def test_other_thresholds_than_the_views_count_stalls_by_them(reference, rows):
    store, _ = reference
    thresholds = replace(DEFAULT_CONFIG.thresholds, stall_factor=7.0)
    analyze(store, ANALYSED, window_s=60, now_ns=next(PASS_TIMES), config=AnalyticsConfig(thresholds=thresholds))
    by_key = {(row["conn_id"], row["req_seq"]): expected_stalls(row, 7.0) for row in rows}
    stored = {(conn_id, req_seq): stalls for conn_id, req_seq, stalls in store.query_rows(
        f"SELECT conn_id, req_seq, stalls FROM {phases_of(store, definition=figures_definition(7.0, DEFAULT_LONG_STREAM_EVENTS))}")}
    assert stored == by_key
    assert sum(by_key.values()) == 0 < sum(expected_stalls(row, 5.0) for row in rows)  # 6x: a stall at 5, not 7

"""The one list of tokenprobe's tables and views, in the order they are created.

``Store.ensure_schema()``, ``deploy/render.py`` (the cluster DDL) and the tests
all read this list, so which tables exist never depends on what a process
happened to import. A new table is declared in its module of this room and
added here.
"""

from __future__ import annotations

from .analysis import (
    INDICATOR_MATRIX,
    KNEE,
    PREFILL_CALIBRATION,
    REQUEST_SPLIT,
    SLO_STATUS,
)
from .decisions import DECISIONS
from .ends import REQUEST_ENDS, REQUEST_ENDS_MV
from .figures import REQUEST_FIGURES, REQUEST_FIGURES_MV
from .gaps import AGENT_GAPS
from .inflight import INFLIGHT_SAMPLES
from .requests import REQUESTS, REQUESTS_FOR_VIEWS, REQUESTS_TABLE
from .rollup import KNEE_ROLLUP, KNEE_ROLLUP_MV, ROLLUP, ROLLUP_MV
from .samples import ENGINE_SAMPLES, GPU_SAMPLES, SERVER_GPUS
from .tables import DEFAULT_DATABASE, DEFAULT_TTL_DAYS, Table, View

TABLES: tuple[Table, ...] = (
    REQUESTS,
    GPU_SAMPLES,
    ENGINE_SAMPLES,
    SERVER_GPUS,
    INFLIGHT_SAMPLES,
    REQUEST_SPLIT,
    PREFILL_CALIBRATION,
    KNEE,
    INDICATOR_MATRIX,
    SLO_STATUS,
    DECISIONS,
    ROLLUP,
    KNEE_ROLLUP,
    REQUEST_ENDS,
    REQUEST_FIGURES,
    AGENT_GAPS,
)
# Created after every table: a materialized view needs the tables it reads and writes.
MATERIALIZED_VIEWS: tuple[View, ...] = (ROLLUP_MV, KNEE_ROLLUP_MV, REQUEST_ENDS_MV, REQUEST_FIGURES_MV)


def tables(embedded: bool = False) -> tuple[Table, ...]:
    """The tables as a store creates them: an embedded store's views read one more, ``requests_for_views``
    (contract/requests.py)."""
    return TABLES + (REQUESTS_FOR_VIEWS,) if embedded else TABLES


def materialized_views(embedded: bool = False) -> tuple[View, ...]:
    """The materialized views as a store creates them: an embedded store's read ``requests_for_views``, which
    the store's writers feed (contract/requests.py)."""
    if not embedded:
        return MATERIALIZED_VIEWS
    return tuple(view.reading(REQUESTS_TABLE, REQUESTS_FOR_VIEWS.name) for view in MATERIALIZED_VIEWS)


def create_statements(database: str = DEFAULT_DATABASE, ttl_days: int = DEFAULT_TTL_DAYS, *,
                      embedded: bool = False) -> list[str]:
    """The statements that create the database, every table and every materialized view, in order, as a
    ClickHouse server has them or (``embedded``) as an embedded store does."""
    if not database.isidentifier():
        raise ValueError(f"database name {database!r} is not a plain identifier")
    if not isinstance(ttl_days, int) or isinstance(ttl_days, bool) or ttl_days < 1:
        raise ValueError(f"ttl_days must be a positive integer, got {ttl_days!r}")
    statements = [f"CREATE DATABASE IF NOT EXISTS {database}"]
    statements += [table.ddl_template.format(db=database, ttl_days=ttl_days) for table in tables(embedded)]
    statements += [view.ddl_template.format(db=database) for view in materialized_views(embedded)]
    return statements

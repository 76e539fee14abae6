"""Schema objects the store manages beyond ``Store.ensure_schema()``: the GPU join view."""

from __future__ import annotations

from ..contract.views import VIEW_NAME, request_gpu_state_sql
from .client import Store


def create_request_gpu_state_view(store: Store) -> str:
    """Create (or replace) the view ``request_gpu_state`` in the store's database; returns its qualified name.

    The tables must exist (``Store.ensure_schema()``).
    """
    name = store.table(VIEW_NAME)
    engines = store.query_rows("SELECT engine FROM system.tables WHERE database = {db:String} AND name = {name:String}",
                               parameters={"db": store.database, "name": VIEW_NAME})
    if engines and engines[0][0] != "View":
        # A cluster's deploy/clickhouse/cluster.sql made it a Distributed table over per-shard views.
        return name
    store.command(f"CREATE OR REPLACE VIEW {name} AS\n{request_gpu_state_sql(store.database)}")
    return name

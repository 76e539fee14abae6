"""The one table of APIs (contract/apis.py): one rule for "inference request", the same in Python and in
SQL, and the dialect each route names is the one the agent reads its responses with."""

from __future__ import annotations

import pytest
from tokenprobe.agent.capture import dialects
from tokenprobe.contract.apis import (
    APIS,
    IS_INFERENCE_SQL,
    is_inference_request,
    operation_name,
)
from tokenprobe.contract.measures import is_inference
from tokenprobe.store import open_store

# Spellings a server may route alike, and routes that run no model.
OTHER_PATHS = ["/health", "/metrics", "/v1/models", "/V1/Chat/Completions/", "/v1/chat/completions//", "//", "",
               "/v2/models/llama/generate_stream", "/v2/models/llama/versions/3/infer/", "/v2/models/llama/ready",
               "/v1/chat/completions/x", "/tokenize", "/api/tags", "/generate/"]


def every_path() -> list[str]:
    return [route for api in APIS for route in api.routes] + OTHER_PATHS


def test_every_route_of_an_inference_api_is_inference_when_posted_only():
    for api in APIS:
        for route in api.routes:
            assert is_inference_request("POST", route) is api.inference, route
            assert not is_inference_request("GET", route), route
            assert operation_name(route) == api.operation
    assert not is_inference_request("POST", "/health")
    assert not is_inference_request("POST", "/v1/models")


def test_the_rows_rule_is_the_gateways_rule():
    for path in every_path():
        for method in ("POST", "GET", "post"):
            assert is_inference({"method": method.upper(), "path": path}) == is_inference_request(method, path)


def test_sql_and_python_agree_on_every_spelling(tmp_path):
    store = open_store(f"chdb://{tmp_path / 'store'}", serve=False)
    try:
        paths = every_path()
        rows = store.query_rows(
            f"SELECT method, path, {IS_INFERENCE_SQL} FROM (SELECT arrayJoin(['POST', 'GET']) AS method, "
            "arrayJoin({paths:Array(String)}) AS path)", parameters={"paths": paths})
    finally:
        store.close()
    assert len(rows) == 2 * len(paths)
    disagreements = [(method, path) for method, path, sql in rows if bool(sql) != is_inference_request(method, path)]
    assert disagreements == []
    assert any(sql for *_, sql in rows) and not all(sql for *_, sql in rows)


def test_a_route_that_names_a_dialect_is_read_with_it():
    named = 0
    for api in APIS:
        for route in api.routes:
            dialect = dialects.for_path(route)
            if api.dialect is None:
                assert dialect is None, route
            else:
                named += 1
                assert dialect is not None and dialect.name == api.dialect, route
    assert named >= 10


@pytest.mark.parametrize("path", ["/generate", "/v1/embeddings"])
def test_routes_without_a_dialect_are_told_by_their_shape(path):
    assert dialects.for_path(path) is None

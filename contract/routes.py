"""Which HTTP requests are inference: the routes of every API dialect tokenprobe knows.

The gateway guards exactly these (a breaker or a budget that a route escapes
is no breaker), so the list errs on the side of inclusion: every route that
makes a server run its model — generation, embeddings, scoring — of each
dialect, as each project documents it. Paths are matched on the canonical
form of the request target (actuator/target.py), case-insensitively and
with a trailing slash ignored, because some servers route them alike.
"""

from __future__ import annotations

import re

INFERENCE_METHOD = "POST"

INFERENCE_ROUTES = frozenset({
    # OpenAI (served by vLLM, SGLang, TGI, llama.cpp, Ollama, LiteLLM, ...), with and without the /v1 prefix
    "/v1/chat/completions", "/chat/completions",
    "/v1/completions", "/completions",
    "/v1/responses", "/responses",
    "/v1/embeddings", "/embeddings",
    "/v1/audio/transcriptions", "/v1/audio/translations",
    # Anthropic Messages (also llama.cpp) and its legacy Text Completions
    "/v1/messages", "/v1/complete",
    # Ollama native
    "/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
    # TGI native; `POST /` is TGI's compat route to generate; SageMaker's /invocations (TGI, vLLM)
    "/generate", "/generate_stream", "/", "/invocations",
    # SGLang native (also /generate)
    "/encode", "/classify", "/v1/score", "/v1/rerank",
    # vLLM pooling and scoring
    "/pooling", "/score", "/rerank", "/v2/rerank",
    # llama.cpp native
    "/completion", "/infill", "/embedding", "/reranking", "/v1/reranking",
})

# KServe v2 / Triton generate extension: /v2/models/NAME[/versions/V]/(generate|generate_stream|infer)
_KSERVE_ROUTE = re.compile(r"^/v2/models/[^/]+(?:/versions/[^/]+)?/(?:generate|generate_stream|infer)$")


def inference_route_sql(path: str = "path") -> str:
    """``is_inference_route`` as a ClickHouse expression over the column ``path``: the same routes and
    KServe pattern, the same case and trailing-slash rules, so SQL and Python agree on every path."""
    canonical = f"if(length({path}) > 1, trimRight(lowerUTF8({path}), '/'), lowerUTF8({path}))"
    routes = ", ".join(f"'{route}'" for route in sorted(INFERENCE_ROUTES))
    return f"(has([{routes}], {canonical}) OR match({canonical}, '{_KSERVE_ROUTE.pattern}'))"


def inference_request_sql(method: str = "method", path: str = "path") -> str:
    """``is_inference_request`` as a ClickHouse expression over the columns ``method`` and ``path``."""
    return f"(upper({method}) = '{INFERENCE_METHOD}' AND {inference_route_sql(path)})"


def is_inference_route(path: str) -> bool:
    """Whether `path` (canonical, without the query) is a route that runs the model."""
    path = path.lower()
    if len(path) > 1:
        path = path.rstrip("/")
    return path in INFERENCE_ROUTES or _KSERVE_ROUTE.match(path) is not None


def is_inference_request(method: str, path: str) -> bool:
    """Whether a request runs the model: a POST to an inference route."""
    return method.upper() == INFERENCE_METHOD and is_inference_route(path)

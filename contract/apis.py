"""The one table of LLM APIs tokenprobe knows, and the one rule for "inference request".

Each API is one entry: its name, the routes it is served on, the dialect module that
reads its responses (agent/capture/dialects/, by the dialect's name), the
OpenTelemetry GenAI operation it performs, and whether a call runs the model. The
agent chooses a response's dialect from it, the exporters name operations from it,
the analytics, the dashboard and the gateway decide from it what an inference
request is. Adding an API is one entry here and one dialect module.

An inference request is a POST to a route of an inference API. The gateway guards
those and the routes that run a server's tokenizer or queue work for its model
(`guarded`): a breaker or a budget that a route escapes is no breaker, so the routes
err on the side of inclusion, as each project documents them. Paths are matched on
the canonical form of the request target (actuator/target.py), case-insensitively
and with a trailing slash ignored, because some servers route them alike. An
OpenAI-style `/v1/...` route is the same route under any prefix a proxy mounts it at
(`/openai/v1/...`, `/api/v1/...`), and Azure's and LiteLLM's per-deployment
spellings (`/openai/deployments/NAME/chat/completions`, `/engines/NAME/completions`)
name it too; the Gemini, Vertex AI and Bedrock routes a proxy such as LiteLLM passes
through are inference routes as well.

Only POST runs a model. On a guarded route the gateway guards POST, passes the safe
methods (GET, HEAD, OPTIONS) when they carry no body, and refuses every other
request (`request_kind`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INFERENCE_METHOD = "POST"
# Methods that run nothing by HTTP's definition (RFC 9110 §9.2.1): listing, CORS preflight.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Api:
    name: str
    routes: tuple[str, ...]
    operation: str            # the OpenTelemetry GenAI operation name (gen_ai.operation.name)
    # The dialect (agent/capture/dialects/) that reads the responses of these routes, by name; None
    # where a response is recognised by its shape instead (a route several APIs share, such as /generate).
    dialect: str | None = None
    inference: bool = True    # a call runs the model: an inference request, for the analytics too
    guarded: bool = True      # the gateway guards it (every inference route, and the tokenizer's and batches')


APIS: tuple[Api, ...] = (
    # OpenAI (served by vLLM, SGLang, TGI, llama.cpp, Ollama, LiteLLM, ...), with and without the /v1 prefix
    Api("openai.chat", ("/v1/chat/completions", "/chat/completions"), "chat", dialect="openai.chat"),
    Api("openai.completions", ("/v1/completions",), "text_completion", dialect="openai.completions"),
    Api("openai.responses", ("/v1/responses", "/responses"), "chat", dialect="openai.responses"),
    Api("openai.embeddings", ("/v1/embeddings", "/embeddings"), "embeddings"),
    Api("openai.audio", ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech",
                         "/audio/transcriptions", "/audio/translations", "/audio/speech"), "generate_content"),
    Api("openai.other", ("/v1/moderations", "/v1/images/generations", "/v1/images/edits"), "generate_content"),
    # Anthropic Messages (also served by llama.cpp) and its legacy Text Completions
    Api("anthropic.messages", ("/v1/messages",), "chat", dialect="anthropic.messages"),
    Api("anthropic.complete", ("/v1/complete",), "text_completion"),
    # Ollama native
    Api("ollama.generate", ("/api/generate",), "text_completion", dialect="ollama.generate"),
    Api("ollama.chat", ("/api/chat",), "chat", dialect="ollama.chat"),
    Api("ollama.embed", ("/api/embed", "/api/embeddings"), "embeddings"),
    # TGI native: /generate is also SGLang's (told apart by shape); `POST /` is TGI's compat route to
    # generate; SageMaker's /invocations (TGI, vLLM)
    Api("tgi", ("/generate_stream",), "text_completion", dialect="tgi"),
    Api("tgi_or_sglang.generate", ("/generate", "/", "/invocations"), "text_completion"),
    # SGLang native
    Api("sglang", ("/encode", "/classify", "/v1/score", "/v1/rerank", "/v1/classify"), "embeddings"),
    # vLLM pooling and scoring
    Api("vllm.pooling", ("/pooling", "/score", "/rerank", "/v2/rerank"), "embeddings"),
    # llama.cpp native: /completion and its alias /completions (also OpenAI's route without /v1:
    # llama.cpp's dialect reads its native shape, an OpenAI-shaped body is read by its shape)
    Api("llamacpp", ("/completion", "/completions"), "text_completion", dialect="llamacpp"),
    Api("llamacpp.other", ("/infill", "/embedding", "/reranking", "/v1/reranking"), "text_completion"),
    # Not inference, guarded: the tokenizer routes of vLLM, SGLang, TGI, llama.cpp and Anthropic (CPU on the
    # server, and a probe of its prompts), and batches, which run the model later on the server's time
    Api("tokenizer", ("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/chat_tokenize",
                      "/v1/messages/count_tokens"), "tokenize", inference=False),
    Api("batches", ("/v1/batches", "/v1/messages/batches"), "batch", inference=False),
)

_V1_ROUTES = sorted({route[len("/v1/"):] for api in APIS if api.inference for route in api.routes
                    if route.startswith("/v1/")})
_V1_ALTERNATIVES = "|".join(route.replace(".", r"\.") for route in _V1_ROUTES)
# Inference routes by pattern (RE2 syntax, so that SQL matches them alike), on the canonical path.
INFERENCE_PATTERNS = (
    # KServe v2 / Triton generate extension: /v2/models/NAME[/versions/V]/(generate|generate_stream|infer)
    r"^/v2/models/[^/]+(?:/versions/[^/]+)?/(?:generate|generate_stream|infer)$",
    # Gemini and Vertex AI (as LiteLLM passes them through): .../models/NAME:METHOD
    r"^/.*/models/[^/]+:(?:generatecontent|streamgeneratecontent|counttokens|embedcontent|batchembedcontents"
    r"|predict|rawpredict|streamrawpredict)$",
    # Amazon Bedrock runtime: /model/ID/(invoke|invoke-with-response-stream|converse|converse-stream)
    r"^/model/[^/]+/(?:invoke|invoke-with-response-stream|converse|converse-stream)$",
    # An OpenAI-style /v1 route mounted under a prefix (/openai/v1/..., /api/v1/...)
    rf"^/.+/v1/(?:{_V1_ALTERNATIVES})$",
    # Azure OpenAI and LiteLLM: the deployment (or engine) named in the path, then the route without /v1
    rf"^(?:/openai|/v1)?/(?:deployments|engines)/[^/]+/(?:{_V1_ALTERNATIVES})$",
)
_PATTERNS = tuple(re.compile(pattern) for pattern in INFERENCE_PATTERNS)
_BY_PATTERN = Api("by_pattern", (), "text_completion")

INFERENCE_ROUTES = frozenset(route for api in APIS if api.inference for route in api.routes)
_API_BY_ROUTE = {route: api for api in APIS for route in api.routes}


def _canonical(path: str) -> str:
    path = path.lower()
    return path.rstrip("/") if len(path) > 1 else path


def api_of(path: str) -> Api | None:
    """The API a route (canonical, without the query) belongs to, if any."""
    path = _canonical(path)
    api = _API_BY_ROUTE.get(path)
    if api is None and any(pattern.match(path) for pattern in _PATTERNS):
        return _BY_PATTERN
    return api


def dialect_routes() -> dict[str, str]:
    """Route → the name of the dialect that reads its responses, for the routes that name one."""
    return {route: api.dialect for api in APIS if api.dialect for route in api.routes}


def operation_name(path: str) -> str | None:
    """The GenAI operation (``chat``, ``text_completion``, ``embeddings``, …) a route serves, if it is one."""
    api = api_of(path)
    return api.operation if api is not None else None


def is_inference_route(path: str) -> bool:
    """Whether `path` (canonical, without the query) is a route that runs the model."""
    api = api_of(path)
    return api is not None and api.inference


def is_inference_request(method: str, path: str) -> bool:
    """THE rule: whether a request runs the model, a POST to an inference route."""
    return method.upper() == INFERENCE_METHOD and is_inference_route(path)


def request_kind(method: str, path: str, has_body: bool) -> str:
    """How a gateway treats a request: "guard" (a POST to a guarded route), "pass" (any other route, or a
    safe method without a body on a guarded route) or "refuse" (any other method there: no API serves it,
    and an upstream that did would run its model unguarded)."""
    api = api_of(path)
    if api is None or not api.guarded:
        return "pass"
    method = method.upper()
    if method == INFERENCE_METHOD:
        return "guard"
    return "pass" if method in SAFE_METHODS and not has_body else "refuse"


def _sql_list(values) -> str:
    return ", ".join("'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'" for value in sorted(values))


def inference_route_sql(path: str = "path") -> str:
    """``is_inference_route`` as a ClickHouse expression over the column ``path``: the same routes and
    patterns (RE2), the same case and trailing-slash rules, so SQL and Python agree on every path."""
    canonical = f"if(length({path}) > 1, replaceRegexpOne(lower({path}), '/+$', ''), lower({path}))"
    return f"({canonical} IN ({_sql_list(INFERENCE_ROUTES)}) OR multiMatchAny({canonical}, [{_sql_list(INFERENCE_PATTERNS)}]))"


def inference_request_sql(method: str = "method", path: str = "path") -> str:
    """``is_inference_request`` as a ClickHouse expression over the columns ``method`` and ``path``."""
    return f"(upper({method}) = '{INFERENCE_METHOD}' AND {inference_route_sql(path)})"


# The rule over a `requests` row's `method` and `path`.
IS_INFERENCE_SQL = inference_request_sql()

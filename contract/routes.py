"""Which HTTP requests are inference: the routes of every API dialect tokenprobe knows.

The gateway guards exactly these (a breaker or a budget that a route escapes
is no breaker), so the list errs on the side of inclusion: every route that
makes a server run its model or its tokenizer — generation, embeddings,
scoring, speech, tokenizing — of each dialect, as each project documents it.
Paths are matched on the canonical form of the request target
(actuator/target.py), case-insensitively and with a trailing slash ignored,
because some servers route them alike. An OpenAI-style `/v1/...` route is
the same route under any prefix a proxy mounts it at (`/openai/v1/...`,
`/api/v1/...`), and Azure's and LiteLLM's per-deployment spellings
(`/openai/deployments/NAME/chat/completions`, `/engines/NAME/completions`)
name it too. The Gemini, Vertex AI and Bedrock routes a proxy such as
LiteLLM passes through are guarded as well.

Only POST runs a model. On an inference route the gateway guards POST,
passes the safe methods (GET, HEAD, OPTIONS) when they carry no body, and
refuses every other request (`request_kind`).
"""

from __future__ import annotations

import re

INFERENCE_METHOD = "POST"
# Methods that run nothing by HTTP's definition (RFC 9110 §9.2.1): listing, CORS preflight.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

INFERENCE_ROUTES = frozenset({
    # OpenAI (served by vLLM, SGLang, TGI, llama.cpp, Ollama, LiteLLM, ...), with and without the /v1 prefix
    "/v1/chat/completions", "/chat/completions",
    "/v1/completions", "/completions",
    "/v1/responses", "/responses",
    "/v1/embeddings", "/embeddings",
    "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech",
    "/audio/transcriptions", "/audio/translations", "/audio/speech",
    # Anthropic Messages (also llama.cpp) and its legacy Text Completions; token counting runs the tokenizer
    "/v1/messages", "/v1/complete", "/v1/messages/count_tokens",
    # Ollama native
    "/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
    # TGI native; `POST /` is TGI's compat route to generate; SageMaker's /invocations (TGI, vLLM)
    "/generate", "/generate_stream", "/", "/invocations",
    # SGLang native (also /generate)
    "/encode", "/classify", "/v1/score", "/v1/rerank", "/v1/classify",
    # vLLM pooling and scoring
    "/pooling", "/score", "/rerank", "/v2/rerank",
    # llama.cpp native
    "/completion", "/infill", "/embedding", "/reranking", "/v1/reranking",
    # The tokenizer routes of vLLM, SGLang, TGI and llama.cpp: CPU on the server, and a probe of its prompts
    "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/chat_tokenize",
    # What an OpenAI-compatible proxy (LiteLLM) also serves: batches run the model later, on the server's time
    "/v1/batches", "/v1/messages/batches", "/v1/moderations", "/v1/images/generations", "/v1/images/edits",
})

_V1_ROUTES = frozenset(route for route in INFERENCE_ROUTES if route.startswith("/v1/"))
_V1 = "/v1/"
# Azure OpenAI and LiteLLM: the deployment (or engine) named in the path, then the route without /v1.
_DEPLOYMENT = re.compile(r"^(?:/openai|/v1)?/(?:deployments|engines)/[^/]+(/.+)$")
_PATTERNS = (
    # KServe v2 / Triton generate extension: /v2/models/NAME[/versions/V]/(generate|generate_stream|infer)
    re.compile(r"^/v2/models/[^/]+(?:/versions/[^/]+)?/(?:generate|generate_stream|infer)$"),
    # Gemini and Vertex AI (as LiteLLM passes them through): .../models/NAME:METHOD
    re.compile(r"^/.*/models/[^/]+:(?:generatecontent|streamgeneratecontent|counttokens|embedcontent"
               r"|batchembedcontents|predict|rawpredict|streamrawpredict)$"),
    # Amazon Bedrock runtime: /model/ID/(invoke|invoke-with-response-stream|converse|converse-stream)
    re.compile(r"^/model/[^/]+/(?:invoke|invoke-with-response-stream|converse|converse-stream)$"),
)


def is_inference_route(path: str) -> bool:
    """Whether `path` (canonical, without the query) is a route that runs the model."""
    path = path.lower()
    if len(path) > 1:
        path = path.rstrip("/")
    if path in INFERENCE_ROUTES or any(pattern.match(path) for pattern in _PATTERNS):
        return True
    deployment = _DEPLOYMENT.match(path)
    if deployment is not None and "/v1" + deployment.group(1) in _V1_ROUTES:
        return True
    mounted = path.find(_V1, 1)
    while mounted != -1:
        if path[mounted:] in _V1_ROUTES:
            return True
        mounted = path.find(_V1, mounted + 1)
    return False


def is_inference_request(method: str, path: str) -> bool:
    """Whether a request runs the model: a POST to an inference route."""
    return method.upper() == INFERENCE_METHOD and is_inference_route(path)


def request_kind(method: str, path: str, has_body: bool) -> str:
    """How a gateway treats a request: "guard" (a POST to an inference route), "pass" (any other route,
    or a safe method without a body on an inference route) or "refuse" (any other method there: no API
    serves it, and an upstream that did would run its model unguarded)."""
    if not is_inference_route(path):
        return "pass"
    method = method.upper()
    if method == INFERENCE_METHOD:
        return "guard"
    return "pass" if method in SAFE_METHODS and not has_body else "refuse"

"""The client's own view of a streamed LLM response, to hold a stored row against.

The client parses what it received itself (it does not use the agent's
dialect modules): which chunks carried generated text, the usage the server
reported, the response id, and when the first text chunk arrived, on the
monotonic clock, next to when the request was sent. A chunk counts as text
when it carries non-empty visible output, the agent's definition of a token
event for these dialects.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import httpx

OPENAI, ANTHROPIC, OLLAMA = "openai.chat", "anthropic.messages", "ollama.chat"
PATHS = {OPENAI: "/v1/chat/completions", ANTHROPIC: "/v1/messages", OLLAMA: "/api/chat"}


@dataclass
class ClientView:
    model: str                  # unique per request: the servers echo it, rows are matched on it
    api: str
    status: int = 0
    http_version: str = ""
    response_id: str = ""
    text_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    send_ns: int = 0
    first_text_ns: int | None = None

    @property
    def ttft_ns(self) -> int | None:
        return None if self.first_text_ns is None else self.first_text_ns - self.send_ns


def request_body(api: str, model: str, max_tokens: int, prompt: str, include_usage: bool,
                 burst: bool = False) -> dict:
    """`burst` asks the matrix's scripted servers (tests/servers/llm_script.py) for unpaced frames."""
    messages = [{"role": "user", "content": prompt}]
    if api == OLLAMA:
        body = {"model": model, "messages": messages, "stream": True, "options": {"num_predict": max_tokens}}
    else:
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}
    if api == OPENAI and include_usage:
        body["stream_options"] = {"include_usage": True}
    if burst:
        body["burst"] = True
    return body


def _read_event(view: ClientView, obj: dict) -> bool:
    """Takes id and usage from one parsed event; True if it carried text."""
    if view.api == OPENAI:
        view.response_id = view.response_id or obj.get("id", "")
        if usage := obj.get("usage"):
            view.prompt_tokens, view.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        return any(c.get("index") == 0 and (c.get("delta") or {}).get("content") for c in obj.get("choices", []))
    if view.api == ANTHROPIC:
        kind = obj.get("type")
        if kind == "message_start":
            view.response_id = obj["message"]["id"]
            view.prompt_tokens = obj["message"]["usage"]["input_tokens"]
        elif kind == "message_delta":
            view.completion_tokens = obj["usage"]["output_tokens"]
        return kind == "content_block_delta" and obj["delta"].get("type") == "text_delta" \
            and bool(obj["delta"].get("text"))
    if obj.get("done"):
        view.prompt_tokens, view.completion_tokens = obj["prompt_eval_count"], obj["eval_count"]
    return bool((obj.get("message") or {}).get("content"))


def _events(buffer: bytearray, api: str):
    """Complete events taken off the front of `buffer`, as parsed JSON."""
    separator = b"\n" if api == OLLAMA else b"\n\n"
    while (end := buffer.find(separator)) >= 0:
        raw = bytes(buffer[:end])
        del buffer[:end + len(separator)]
        if api == OLLAMA:
            if raw.strip():
                yield json.loads(raw)
            continue
        for line in raw.split(b"\n"):
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                yield json.loads(line[5:])


def stream(client: httpx.Client, api: str, max_tokens: int, *, include_usage: bool = True, burst: bool = False,
           prompt: str = "how many tokens does this prompt have") -> ClientView:
    """One streamed request on `client` (its base URL names the server)."""
    view = ClientView(model=f"m-{uuid.uuid4().hex[:12]}", api=api)
    body = request_body(api, view.model, max_tokens, prompt, include_usage, burst)
    view.send_ns = time.monotonic_ns()
    with client.stream("POST", PATHS[api], json=body) as response:
        view.status, view.http_version = response.status_code, response.http_version
        buffer = bytearray()
        for data in response.iter_raw():
            arrived = time.monotonic_ns()
            buffer += data
            for obj in _events(buffer, api):
                if _read_event(view, obj):
                    view.text_chunks += 1
                    view.first_text_ns = view.first_text_ns or arrived
    return view

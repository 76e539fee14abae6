"""The assembler's cost per SSE event, fast path against the general path, side by side.

In-process, no kernel: each scenario is one streamed OpenAI chat or completions
response fed to `HttpConnectionAssembler` as the server wrote it, with
`fast_path=True` (the agent's) and `fast_path=False` (the general framing,
every event parsed: what the fast path falls back to). Scenarios:

- (a) one event a write, as vLLM and SGLang (uvicorn) write: n=1 and n=2;
- (b) 16 events a write (one writev of 16 chunks, as hyper and libuv coalesce): n=1 and n=2;
- (c) the real vLLM captures in tests/data/fixtures/, one chunk a write.

Every stream names id and model in its first event and ends with a finish
reason and a usage event. Per scenario and path: events per second and µs per
event (CPU time, the best of several runs, the paths interleaved), then the CPU hot spots
of each path (cProfile, top 5 by cumulative time). Prints figures; asserts nothing.

    .venv/bin/python -m benchmarks.bench_assembler [--events N] [--runs R]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from tokenprobe.agent.capture.wire.assembler import HttpConnectionAssembler

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "data" / "fixtures"
KEY = b"bench-key"
TARGET_SPEEDUP = 3.0  # on (a), fast against general
RESPONSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
WORDS = ["mit", " ween", " Ex", "(':')", "cy", " Sp", "Convert", " \\u00e9t\\u00e9", "\\n", " the"]


def request(path: str) -> bytes:
    body = b'{"model":"small","stream":true,"stream_options":{"include_usage":true},"messages":[]}'
    return (f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def chunk(event: bytes) -> bytes:
    return b"%x\r\n" % len(event) + event + b"\r\n"


def chat_events(count: int, n: int) -> list[bytes]:
    """vLLM's chat stream, byte for byte in its shape: role event, text, finish, usage."""
    head = ('{"id":"chatcmpl-90137e70dd9c3d12","object":"chat.completion.chunk","created":1796073273,'
            '"model":"small","choices":[')
    events = [head + ",".join(f'{{"index":{i},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                              f'"finish_reason":null}}' for i in range(n)) + '],"prompt_token_ids":null}']
    for k in range(count):
        for i in range(n):
            finish = '"length","stop_reason":null' if k == count - 1 else "null"
            events.append(head + f'{{"index":{i},"delta":{{"content":"{WORDS[k % len(WORDS)]}"}},'
                                 f'"logprobs":null,"finish_reason":{finish},"token_ids":null}}]}}')
    events.append(head + '],"usage":{"prompt_tokens":37,"total_tokens":%d,"completion_tokens":%d},'
                         '"system_fingerprint":"vllm-0.32.0-131f28f2"}' % (37 + count * n, count * n))
    return [b"data: " + e.encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def synthetic(count: int, n: int, per_write: int) -> tuple[bytes, list[bytes], int]:
    """(request, writes, events) of a chat stream, `per_write` chunks a write."""
    chunks = [chunk(e) for e in chat_events(count, n)] + [b"0\r\n\r\n"]
    writes = [RESPONSE_HEAD] + [b"".join(chunks[i:i + per_write]) for i in range(0, len(chunks), per_write)]
    return request("/v1/chat/completions"), writes, len(chunks) - 1


def captured(name: str) -> tuple[bytes, list[bytes], int]:
    """(request, writes, events) of a real vLLM capture, one chunk a write."""
    body = (FIXTURES / f"vllm_sse_{name}.request.json").read_bytes()
    path = "/v1/chat/completions" if name == "chat" else "/v1/completions"
    req = (f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
           f"content-length: {len(body)}\r\n\r\n").encode() + body
    response = (FIXTURES / f"vllm_sse_{name}.bin").read_bytes()
    head_end = response.index(b"\r\n\r\n") + 4
    writes, pos = [response[:head_end]], head_end
    while pos < len(response):
        size_end = response.index(b"\r\n", pos)
        stop = size_end + 2 + int(response[pos:size_end], 16) + 2
        writes.append(response[pos:stop])
        pos = stop
    return req, writes, len(writes) - 2  # less the header block and the last chunk


def feed(req: bytes, writes: list[bytes], repeat: int, fast_path: bool) -> None:
    """The stream `repeat` times over on one keep-alive connection."""
    asm = HttpConnectionAssembler(fingerprint_key=KEY, fast_path=fast_path)
    ts = 0
    for _ in range(repeat):
        asm.feed_request_bytes(ts, req, len(req))
        for write in writes:
            ts += 1
            asm.feed_response_bytes(ts, write, len(write))
    asm.close(ts, "server_closed")


def best_seconds(req, writes, repeat, fast_path, runs) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        feed(req, writes, repeat, fast_path)
        best = min(best, time.process_time() - start)
    return best


def hot_spots(req, writes, repeat, fast_path) -> list[tuple[str, int, float, float, float]]:
    """(function, calls, cumulative ms, cumulative µs a call, own ms) of the top 5 assembler functions."""
    profile = cProfile.Profile()
    profile.runcall(feed, req, writes, repeat, fast_path)
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profile).stats.items():
        if "/agent/capture/" in filename:
            where = f"{filename.rsplit('/agent/capture/', 1)[1]}:{line} {name}"
            rows.append((where, calls, cumulative * 1e3, cumulative / calls * 1e6, own * 1e3))
    return sorted(rows, key=lambda row: -row[2])[:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=256, help="text events a synthetic stream")
    parser.add_argument("--runs", type=int, default=7, help="runs a figure, the best kept")
    args = parser.parse_args()
    scenarios = {
        "(a) 1 event/write, n=1": synthetic(args.events, 1, 1),
        "(a) 1 event/write, n=2": synthetic(args.events // 2, 2, 1),
        "(b) 16 events/write, n=1": synthetic(args.events, 1, 16),
        "(b) 16 events/write, n=2": synthetic(args.events // 2, 2, 16),
        "(c) vLLM capture, chat": captured("chat"),
        "(c) vLLM capture, completions": captured("completions"),
    }
    print(f"assembler cost per SSE event: best of {args.runs} runs, fast path vs general path\n")
    print(f"{'scenario':32}{'events':>8}{'fast ev/s':>12}{'fast µs/ev':>12}"
          f"{'general ev/s':>14}{'general µs/ev':>15}{'speed-up':>10}")
    for label, (req, writes, events) in scenarios.items():
        repeat = max(1, 4000 // events)  # about 4000 events a run
        fast = best_seconds(req, writes, repeat, True, args.runs) / (events * repeat)
        general = best_seconds(req, writes, repeat, False, args.runs) / (events * repeat)
        print(f"{label:32}{events:8}{1 / fast:12.0f}{fast * 1e6:12.2f}{1 / general:14.0f}"
              f"{general * 1e6:15.2f}{general / fast:9.1f}x")
    print(f"\ntarget: (a) at least {TARGET_SPEEDUP:.0f}x faster per event on the fast path than the general path")
    req, writes, events = scenarios["(a) 1 event/write, n=1"]
    for fast_path in (True, False):
        print(f"\nhot spots, (a) n=1, {'fast' if fast_path else 'general'} path (cProfile, by cumulative time)")
        print(f"{'function':56}{'calls':>8}{'cum ms':>10}{'cum µs/call':>13}{'own ms':>9}")
        for where, calls, cum_ms, per_call, own_ms in hot_spots(req, writes, max(1, 4000 // events), fast_path):
            print(f"{where:56}{calls:8}{cum_ms:10.1f}{per_call:13.2f}{own_ms:9.1f}")


if __name__ == "__main__":
    main()

"""What the agent costs the server it watches, and how many events it keeps up with.

Part 1 runs the same closed-loop load against the reference server twice in
one run, without and with `tokenprobe agent` attached, and prints throughput
and client-side TTFT/latency side by side as ratios.

Part 2 does the same per protocol against one hypercorn SSE server
(refserver/h2_sse.py): HTTP/1.1 (one connection per concurrent stream) next
to HTTP/2 in the clear (h2c, every stream multiplexed on one connection, each
frame parsed and each header block HPACK-decoded by the agent).

Part 3 points the agent at a "firehose": a server that streams tiny SSE
chunks, one write() each, at a set rate; it prints, per offered rate, the
events the agent processed per second and the share the kernel dropped
because the agent fell behind (the workload never waits for the agent).

Prints figures; asserts nothing. Needs root (real BPF). Run: make bench
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from tokenprobe.refserver.harness import (
    agent,
    free_port,
    listening_process,
    reference_server,
)
from tokenprobe.refserver.loadgen import LoadConfig, burst
from tokenprobe.store.embedded import open_store

SSE_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
CHUNK = b"%x\r\n%s\r\n" % (len(SSE_EVENT), SSE_EVENT)


def figures(elapsed: float, requests: int, tokens: int, ttfts_ms: list[float], totals_ms: list[float],
            errors: int) -> dict:
    ttfts, totals = sorted(ttfts_ms), sorted(totals_ms)
    return {
        "requests/s": requests / elapsed,
        "tokens/s": tokens / elapsed,
        "TTFT p50 ms": statistics.median(ttfts),
        "TTFT p99 ms": ttfts[int(0.99 * (len(ttfts) - 1))],
        "latency p50 ms": statistics.median(totals),
        "latency p99 ms": totals[int(0.99 * (len(totals) - 1))],
        "errors": errors,
    }


def load_figures(port: int, requests: int, concurrency: int) -> dict:
    config = LoadConfig(port=port, requests=requests, duration_s=None, prompt_tokens=(16, 256),
                        max_tokens=(16, 64), stream_fraction=1.0, seed=7)
    started = time.monotonic()
    result = burst(config, n=requests, concurrency=concurrency, per_connection=8)
    elapsed = time.monotonic() - started
    return figures(elapsed, len(result.records), sum(r.token_events for r in result.records),
                   [r.ttft_ns / 1e6 for r in result.records if r.ttft_ns is not None],
                   [(r.end_ns - r.send_ns) / 1e6 for r in result.records if r.end_ns and r.send_ns],
                   len(result.errors))


def overhead(tmp: Path, requests: int, concurrency: int) -> None:
    print(f"== server cost: {requests} streamed requests, {concurrency} concurrent, reference server "
          "with 64 slots and 2 ms per token")
    with reference_server(tmp, slots=64, decode_ms=2.0, prefill_base_ms=1.0) as (port, _truth):
        load_figures(port, 40, concurrency)  # warm-up
        without = load_figures(port, requests, concurrency)
        with agent(tmp, ports=[port]) as handle:
            attached = load_figures(port, requests, concurrency)
            handle.stop()
        again = load_figures(port, requests, concurrency)  # drift check: no agent again
    print(f"{'':18}{'no agent':>12}{'agent':>12}{'agent/no':>10}{'no agent again':>16}")
    for key in without:
        base = without[key]
        ratio = f"{attached[key] / base:10.3f}" if base else f"{'-':>10}"
        print(f"{key:18}{base:12.2f}{attached[key]:12.2f}{ratio}{again[key]:16.2f}")


async def _stream_load(port: int, http2: bool, requests: int, concurrency: int) -> dict:
    """`concurrency` workers streaming chats back to back: over HTTP/1.1 each on its own
    keep-alive connection, over h2c all on one connection."""
    ttfts, totals, tokens, errors, left = [], [], 0, 0, iter(range(requests))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", http1=not http2, http2=http2, timeout=60,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker() -> None:
            nonlocal tokens, errors
            for n in left:
                sent = time.monotonic_ns()
                first = None
                async with client.stream("POST", "/v1/chat/completions", json={"model": "bench", "n": n % 16}) \
                        as response:
                    async for chunk in response.aiter_raw():
                        first = first or time.monotonic_ns()
                        tokens += chunk.count(b'"content": "t')
                if response.status_code != 200 or first is None:
                    errors += 1
                    continue
                ttfts.append((first - sent) / 1e6)
                totals.append((time.monotonic_ns() - sent) / 1e6)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    return figures(elapsed, len(totals), tokens, ttfts, totals, errors)


def protocol_overhead(tmp: Path, requests: int, concurrency: int) -> None:
    print(f"\n== server cost per protocol: {requests} streamed requests, {concurrency} concurrent, "
          "hypercorn SSE (12-27 events, 2 ms apart)")
    protocols = (("HTTP/1.1", False), ("h2c", True))
    runs: dict[tuple[str, bool], dict] = {}
    port = free_port()  # hypercorn serves HTTP/1.1 and h2c (prior knowledge) on one port
    with listening_process([sys.executable, "-m", "tokenprobe.refserver.h2_sse", str(port)], port):
        for name, http2 in protocols:
            asyncio.run(_stream_load(port, http2, 40, concurrency))  # warm-up
            runs[name, False] = asyncio.run(_stream_load(port, http2, requests, concurrency))
        with agent(tmp, ports=[port]) as handle:
            for name, http2 in protocols:
                runs[name, True] = asyncio.run(_stream_load(port, http2, requests, concurrency))
            handle.stop()
    print(f"{'':18}" + "".join(f"{name + ' no agent':>18}{'agent':>10}{'agent/no':>10}" for name, _ in protocols))
    for key in runs["HTTP/1.1", False]:
        line = f"{key:18}"
        for name, _ in protocols:
            base, attached = runs[name, False][key], runs[name, True][key]
            ratio = f"{attached / base:10.3f}" if base else f"{'-':>10}"
            line += f"{base:18.2f}{attached:10.2f}{ratio}"
        print(line)
    store = open_store(handle.store_url, serve=False)
    try:
        stored = dict(store.query_df("SELECT protocol, count() AS n FROM tokenprobe.requests WHERE outcome = "
                                     "'complete' GROUP BY protocol").itertuples(index=False))
    finally:
        store.close()
    print(f"{'complete rows':18}" + "".join(f"{stored.get(label, 0):>18}" + " " * 20
                                            for label in ("http/1.1", "h2c")) + f"  (of {requests} each)")


class Firehose:
    """Streams SSE chunks at `rate` writes/s per connection until stopped."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.port = free_port()
        self.sent = 0
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            interval = 1.0 / self.rate
            next_at = time.monotonic()
            while not self._stop.is_set():
                now = time.monotonic()
                # Catch up in a burst when late; never sleep below the scheduler's resolution.
                while next_at <= now:
                    conn.send(CHUNK)
                    self.sent += 1
                    next_at += interval
                time.sleep(max(0.0, min(0.001, next_at - now)))

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()


def drain(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 20):
            pass
    except OSError:
        pass


def firehose(tmp: Path, rates: list[float], seconds: float) -> None:
    print(f"\n== agent capacity: one stream of 1-event writes, {seconds:.0f}s per rate, 16 MiB ring buffer")
    print(f"{'offered ev/s':>14}{'written ev/s':>14}{'agent ev/s':>12}{'dropped':>10}")
    for rate in rates:
        run_dir = Path(tempfile.mkdtemp(dir=tmp))
        hose = Firehose(rate)
        with agent(run_dir, ports=[hose.port]) as handle:
            client = socket.create_connection(("127.0.0.1", hose.port))
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 2\r\n\r\n{}")
            threading.Thread(target=drain, args=(client,), daemon=True).start()
            time.sleep(seconds)
            hose.stop()
            written = hose.sent
            handle.stop()
            client.close()
        summary = re.search(r"from (\d+) kernel events in ([\d.]+)s.*?(\d+) events dropped", handle.log(), re.S)
        # The agent's own run time includes compiling the probes: rate over the stream's time.
        if not summary:
            print(f"{rate:14.0f}  agent summary missing:\n{handle.log()[-500:]}")
            continue
        events, dropped = int(summary[1]), int(summary[3])
        share = dropped / max(1, events + dropped)
        print(f"{rate:14.0f}{written / seconds:14.0f}{events / seconds:12.0f}{share:10.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rates", type=float, nargs="+", default=[5000, 20000, 50000, 100000])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenprobe-bench-") as tmp:
        overhead(Path(tmp), args.requests, args.concurrency)
        protocol_overhead(Path(tmp), args.requests, args.concurrency)
        firehose(Path(tmp), args.rates, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

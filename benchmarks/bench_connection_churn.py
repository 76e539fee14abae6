"""100k connections through the agent, open then closed: its memory per tracked connection, and back down after.

1. The real connection tracker in this process, fed the kernel events of
   100k connections: each accepted, one request answered, half of them with a
   second request in flight; RSS before, with all of them open (the peak) and
   after they close, and the bytes each tracked connection costs. Then the
   same 100k again with every close lost (closed in ways the probes do not
   see), recovered by the idle timeout: RSS after the eviction, and the
   requests still counted in flight (0).
2. With --agent (root: real BPF): the real `tokenprobe agent` watching a tiny
   epoll server started here; 100k connections in batches of --batch held open
   at once (each asks one request and reads its answer), then reset. The
   agent's RSS (its own /metrics) before, at each batch's peak once it follows
   every connection of the batch, and after the last.

Prints figures; asserts nothing.

    .venv/bin/python -m benchmarks.bench_connection_churn [--connections N] [--agent [--batch B]]
"""

from __future__ import annotations

import argparse
import gc
import resource
import selectors
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
from tokenprobe.agent.capture.kernel.records import (
    DIR_READ,
    DIR_WRITE,
    EV_ACCEPT,
    EV_CLOSE,
    EV_DATA,
    KernelEvent,
)
from tokenprobe.agent.capture.tracker import ConnectionTracker
from tokenprobe.agent.sampling.prom_text import scrape
from tokenprobe.refserver.harness import agent, free_port, wait_for_port

REQUEST_BODY = b'{"model":"m","prompt":"hi"}'
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(REQUEST_BODY), REQUEST_BODY))
RESPONSE_BODY = b'{"id":"cmpl-1","model":"m","usage":{"prompt_tokens":2,"completion_tokens":1}}'
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(RESPONSE_BODY), RESPONSE_BODY))
SERVER_PID = 4242
IDLE_TIMEOUT_S = 60.0
FD_MARGIN = 1024  # descriptors besides the connections: the store, the agent's own, Python's


def rss_bytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def mib(n: float) -> str:
    return f"{n / (1 << 20):8.1f} MiB"


def raise_fd_limit(need: int) -> int:
    """Room for `need` sockets where it can be had (root may raise the hard limit, outside a
    container that withholds CAP_SYS_RESOURCE); returns how many sockets fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need + FD_MARGIN
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
        except (ValueError, PermissionError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return min(need, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_MARGIN)


# -- 1: the tracker alone -------------------------------------------------------------------------

def event(kind: int, ts: int, fd: int, direction: int = DIR_READ, data: bytes = b"",
          counted: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))) -> KernelEvent:
    """A kernel event of connection `fd`, with its counters (bytes, events) before it as the kernel numbers them."""
    return KernelEvent(kind, ts, fd * 1000, counted[0], counted[1], SERVER_PID, fd, direction, False, 0,
                       len(data), len(data), data, b"", 8000, 40000 + fd % 20000, "127.0.0.1", "server")


def open_connections(tracker: ConnectionTracker, n: int, t0: int) -> None:
    """n connections accepted, each with one exchange done and every other one with a request in flight."""
    req, resp = len(REQUEST), len(RESPONSE)
    for fd in range(10, 10 + n):
        ts = t0 + fd * 1000
        tracker.handle(event(EV_ACCEPT, ts, fd))
        tracker.handle(event(EV_DATA, ts + 1, fd, DIR_READ, REQUEST))
        tracker.handle(event(EV_DATA, ts + 2, fd, DIR_WRITE, RESPONSE, ((req, 0), (1, 0))))
        if fd % 2:
            tracker.handle(event(EV_DATA, ts + 3, fd, DIR_READ, REQUEST, ((req, resp), (1, 1))))


def close_connections(tracker: ConnectionTracker, n: int, ts: int) -> None:
    req, resp = len(REQUEST), len(RESPONSE)
    for fd in range(10, 10 + n):
        counted = ((2 * req, resp), (2, 1)) if fd % 2 else ((req, resp), (1, 1))
        tracker.handle(event(EV_CLOSE, ts, fd, counted=counted))


def tracker_churn(n: int) -> None:
    rows = 0

    def count(_row: dict) -> None:
        nonlocal rows
        rows += 1

    tracker = ConnectionTracker(count, clock=MonotonicWallClock(), fingerprint_key=b"bench", node="bench",
                                target_ports={8000}, idle_timeout_s=IDLE_TIMEOUT_S)
    before = rss_bytes()
    print(f"tracker, {n} connections, each one exchange done, every other one with a request in flight")
    print(f"  RSS before            {mib(before)}")
    started = time.perf_counter()
    open_connections(tracker, n, t0=1_000_000_000)
    peak = rss_bytes()
    print(f"  RSS all open (peak)   {mib(peak)}   {len(tracker.connections)} tracked, "
          f"{sum(tracker.stats.inflight.values())} in flight, {(peak - before) / n:.0f} bytes per tracked connection")
    close_connections(tracker, n, ts=2_000_000_000)
    closed = rss_bytes()
    print(f"  RSS all closed        {mib(closed)}   {len(tracker.connections)} tracked, "
          f"{sum(tracker.stats.inflight.values())} in flight, {rows} rows, "
          f"{time.perf_counter() - started:.1f} s")

    print(f"tracker, the same {n} again with every close lost, then the idle timeout ({IDLE_TIMEOUT_S:g} s)")
    t0 = 3_000_000_000
    open_connections(tracker, n, t0=t0)
    peak = rss_bytes()
    print(f"  RSS all open (peak)   {mib(peak)}   {len(tracker.connections)} tracked")
    evicted = tracker.evict_idle(t0 + (10 + n) * 1000 + int(IDLE_TIMEOUT_S * 1e9) + 10)
    after = rss_bytes()
    print(f"  RSS after eviction    {mib(after)}   {evicted} evicted, {len(tracker.connections)} tracked, "
          f"{sum(tracker.stats.inflight.values())} in flight")


# -- 2: the real agent ----------------------------------------------------------------------------

def serve(port: int, capacity: int) -> None:
    """A tiny epoll server: answers every request with RESPONSE, closes on EOF or reset."""
    raise_fd_limit(capacity)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(4096)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            sock = key.fileobj
            if sock is listener:
                try:
                    while True:
                        conn, _ = listener.accept()
                        conn.setblocking(False)
                        selector.register(conn, selectors.EVENT_READ)
                except BlockingIOError:
                    continue
            try:
                data = sock.recv(4096)
            except (BlockingIOError, ConnectionError):
                data = b""
            if data:
                sock.send(RESPONSE)
            else:
                selector.unregister(sock)
                sock.close()


def agent_figure(metrics_port: int, name: str) -> float:
    page = scrape(f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=10)
    return next(sample.value for sample in page.samples if sample.name == name)


def settle(metrics_port: int, name: str, want: float, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while agent_figure(metrics_port, name) != want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agent's {name} did not reach {want}")
        time.sleep(0.5)


def agent_churn(n: int, batch: int) -> None:
    # Here, not above: the agent's module loads the store's engine, which part 1's RSS must not carry.
    from tokenprobe.agent.runner import RESCAN_INTERVAL_S

    batch = raise_fd_limit(batch)
    port, metrics_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_connection_churn", "--serve", str(port),
                               "--batch", str(batch)])
    linger_reset = struct.pack("ii", 1, 0)  # close with RST: no TIME_WAIT to run out of ports
    try:
        wait_for_port(port)
        # A store that does not answer (the last --store wins): rows go to the disk spool, so the
        # RSS is the agent's own, not an embedded database's.
        with tempfile.TemporaryDirectory() as tmp, \
                agent(Path(tmp), "--store", f"http://127.0.0.1:{free_port()}/", "--metrics-port", str(metrics_port),
                      "--analyze-every", "0", "--nvml-hz", "0", ports=[port]) as handle:
            wait_for_port(metrics_port)
            rss = "process_resident_memory_bytes"
            print(f"agent (pid {handle.proc.pid}), {n} connections in batches of {batch}, each one exchange")
            before = agent_figure(metrics_port, rss)
            print(f"  RSS before            {mib(before)}")
            done = 0
            while done < n:
                size = min(batch, n - done)
                clients = []
                for _ in range(size):
                    client = socket.create_connection(("127.0.0.1", port))
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_reset)
                    client.sendall(REQUEST)
                    clients.append(client)
                for client in clients:
                    client.recv(4096)
                settle(metrics_port, "tokenprobe_agent_open_connections", size)
                peak = agent_figure(metrics_port, rss)
                for client in clients:
                    client.close()
                done += size
                settle(metrics_port, "tokenprobe_agent_open_connections", 0)
                time.sleep(RESCAN_INTERVAL_S + 1)  # the agent hands freed memory back at its rescans
                # Per connection from the first batch alone: later ones reuse what it freed.
                cost = "" if done > size else f"   {(peak - before) / size:.0f} bytes per tracked connection"
                print(f"  RSS {size} open (peak)  {mib(peak)}{cost}")
                print(f"  RSS then all closed    {mib(agent_figure(metrics_port, rss))}   ({done} connections so far)")
            overflows = {s.labels["map"]: s.value for s in scrape(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=10).samples
                if s.name == "tokenprobe_agent_map_overflows_total" and s.value}
            print(f"  RSS after             {mib(agent_figure(metrics_port, rss))}   in flight "
                  f"{agent_figure(metrics_port, 'tokenprobe_agent_inflight_requests'):.0f}, "
                  f"kernel drops {agent_figure(metrics_port, 'tokenprobe_agent_drops_total'):.0f}, "
                  f"map overflows {overflows or 'none'}")
            handle.stop()
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=100_000)
    parser.add_argument("--agent", action="store_true", help="also through the real agent (root, BPF)")
    parser.add_argument("--batch", type=int, default=20_000,
                        help="connections the agent run holds open at once, as far as RLIMIT_NOFILE allows")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.batch)
        return
    tracker_churn(args.connections)
    if args.agent:
        agent_churn(args.connections, args.batch)


if __name__ == "__main__":
    main()

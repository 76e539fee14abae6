"""What the embedded store's guard of its readers costs them, and what slow sockets cost them.

1. Judging a statement (``store/guard.py``: the engine's single-statement text of it, its syntax tree
   and, for a SELECT, its query tree) against running it, in-process on a real chDB engine, for a
   dashboard-like query over an empty ``requests`` table (the judgement does not grow with the rows).
2. A reader's queries through the owner's HTTP interface, alone and while ``--tricklers`` sockets
   that never authenticate trickle a request line a byte every 0.2 s (issue 35: 64 of them once
   locked every reader out for 75 s).

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time

import chdb

from tokenprobe.store.embedded import open_store
from tokenprobe.store.guard import StatementGuard

DASHBOARD_LIKE = (
    "SELECT server_port, quantiles(0.5, 0.99)(toUnixTimestamp64Nano(first_token) - toUnixTimestamp64Nano(req_end))"
    " FROM tokenprobe.requests WHERE req_start >= fromUnixTimestamp64Nano({since:Int64}) AND model IN"
    " (SELECT model FROM tokenprobe.requests GROUP BY model) GROUP BY server_port")


def per_call_ms(call, rounds: int) -> float:
    for _ in range(5):
        call()
    started = time.perf_counter()
    for _ in range(rounds):
        call()
    return (time.perf_counter() - started) / rounds * 1000


def judging(directory: str, rounds: int) -> None:
    connection = chdb.connect(directory)
    try:
        def names(sql: str) -> list[str]:
            return connection.query(sql, "TabSeparated").bytes().decode().split()

        guard = StatementGuard("tokenprobe", names("SELECT name FROM system.table_functions"),
                               names("SELECT name FROM system.settings"))
        params = {"since": "0"}
        judge = per_call_ms(lambda: guard.judge(connection, DASHBOARD_LIKE, params, reader=True), rounds)
        run = per_call_ms(lambda: connection.query(DASHBOARD_LIKE, "Native", params=params), rounds)
    finally:
        connection.close()
    print(f"judging a dashboard-like SELECT: {judge:.2f} ms; running it: {run:.2f} ms ({rounds} rounds)")


def trickle(port: int, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
                for byte in b"POST /?query=SELECT+1 HTTP/1.1\r\n" * 100:
                    if stop.wait(0.2):
                        return
                    connection.sendall(bytes([byte]))
        except OSError:
            pass  # closed by the server: come back


def reader_latencies(directory: str, queries: int) -> list[float]:
    reader = open_store(f"chdb://{directory}", serve=False, read_only=True)
    try:
        latencies = []
        for _ in range(queries):
            started = time.perf_counter()
            reader.query_rows("SELECT count() FROM tokenprobe.requests")
            latencies.append((time.perf_counter() - started) * 1000)
        return latencies
    finally:
        reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="statements judged and run")
    parser.add_argument("--tricklers", type=int, default=64, help="unauthenticated trickling sockets")
    parser.add_argument("--queries", type=int, default=30, help="reader queries timed, alone and under the sockets")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="bench-store-guard-")
    with open_store(f"chdb://{directory}") as owner:
        owner.ensure_schema()
        judging(directory, args.rounds)
        alone = reader_latencies(directory, args.queries)
        stop = threading.Event()
        port = owner._ownership.server.port
        threads = [threading.Thread(target=trickle, args=(port, stop)) for _ in range(args.tricklers)]
        for thread in threads:
            thread.start()
        time.sleep(6)  # past the head timeout: every trickler has been cut off and come back once
        try:
            attacked = reader_latencies(directory, args.queries)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
    for label, latencies in (("alone", alone), (f"under {args.tricklers} tricklers", attacked)):
        print(f"reader queries {label}: median {statistics.median(latencies):.0f} ms, max {max(latencies):.0f} ms"
              f" ({len(latencies)} queries, connect included in the first)")


if __name__ == "__main__":
    main()

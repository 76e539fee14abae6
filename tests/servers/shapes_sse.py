"""An SSE server whose accept and write shapes are chosen on the command line,
to reproduce what real servers do to the bytes the probes see.

Run: python shapes_sse.py PORT [--host ADDR] [--null-accept] [--shape event|writev|flat] [--pad N]
        [--events-per-writev N] [--tls CERT KEY] [--workers N --connections-per-worker M]

- --null-accept: accept4(fd, NULL, NULL, 0), as libuv and cpp-httplib do; the
  kernel is given no buffer for the peer's address.
- --shape event: one send() per SSE event, as one HTTP chunk.
  writev: 16 events (--events-per-writev) per writev(), three iovecs each
  (chunk-size line, event, CRLF), as hyper and libuv coalesce them.
  flat: the whole body in one send() (20–40 KiB with --pad 2000), as a
  buffered server flushes it.
- --pad N: N bytes of generated text per event.
- --tls CERT KEY: CPython's ssl on the socket (a flat body goes out in 16 KiB records).
- --workers N: pre-fork, as gunicorn does: the process that listens forks N
  workers that accept on the inherited socket; each serves M connections
  (--connections-per-worker) and exits, and a new worker is forked in its place.

A POST's JSON body names max_tokens (events), id (the response id) and
optionally delay_ms (a pause before each event, with --shape event); every
stream ends with a usage event and [DONE], and names the serving process as
its model (pid-PID). Connections are kept alive."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import ssl
import threading
import time


def accept_null(listener: socket.socket) -> socket.socket:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.accept4(listener.fileno(), None, None, 0)
    if fd < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return socket.socket(fileno=fd)


def read_request(conn: socket.socket, buf: bytearray) -> dict | None:
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(rest) < length:
        data = conn.recv(65536)
        if not data:
            return None
        rest += data
    buf[:] = rest[length:]
    return json.loads(rest[:length])


def events(request: dict, pad: int) -> list[bytes]:
    rid, n, model = request["id"], request["max_tokens"], f"pid-{os.getpid()}"
    out = []
    for i in range(n):
        text = f"t{i}-" + "x" * pad
        out.append(b"data: " + json.dumps({"id": rid, "model": model, "choices": [
            {"index": 0, "text": text}]}).encode() + b"\n\n")
    out.append(b"data: " + json.dumps({"id": rid, "model": model, "choices": [], "usage": {
        "prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def chunk(event: bytes) -> list[bytes]:
    return [b"%x\r\n" % len(event), event, b"\r\n"]


def respond(conn: socket.socket, request: dict, shape: str, pad: int, per_writev: int) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    body = events(request, pad)
    end = b"0\r\n\r\n"
    if shape == "flat":
        conn.sendall(head + b"".join(b"".join(chunk(e)) for e in body) + end)
        return
    conn.sendall(head)
    if shape == "event":
        for event in body:
            time.sleep(request.get("delay_ms", 0) / 1000)
            conn.sendall(b"".join(chunk(event)))
    else:
        for start in range(0, len(body), per_writev):
            iovecs = [part for event in body[start:start + per_writev] for part in chunk(event)]
            total, sent = sum(map(len, iovecs)), os.writev(conn.fileno(), iovecs)
            if sent != total:  # a short write on a loopback socket: finish it flat
                conn.sendall(b"".join(iovecs)[sent:])
    conn.sendall(end)


def serve(conn: socket.socket, args: argparse.Namespace, tls: ssl.SSLContext | None) -> None:
    buf = bytearray()
    try:
        if tls is not None:
            conn = tls.wrap_socket(conn, server_side=True)  # closes the socket if the handshake fails
        with conn:
            while (request := read_request(conn, buf)) is not None:
                respond(conn, request, args.shape, args.pad, args.events_per_writev)
    except (ConnectionError, ssl.SSLError):
        pass


def accept_forever(listener: socket.socket, args: argparse.Namespace, limit: int | None = None) -> None:
    tls = None
    if args.tls:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(*args.tls)
    threads = []
    while limit is None or len(threads) < limit:
        conn = accept_null(listener) if args.null_accept else listener.accept()[0]
        threads.append(threading.Thread(target=serve, args=(conn, args, tls), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()


def prefork(listener: socket.socket, args: argparse.Namespace) -> None:
    """Keeps --workers workers accepting on the inherited listener, replacing each that exits;
    SIGTERM ends them all."""
    workers: set[int] = set()

    def spawn() -> None:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            accept_forever(listener, args, limit=args.connections_per_worker)
            os._exit(0)
        workers.add(pid)

    def stop(_signum, _frame) -> None:
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    for _ in range(args.workers):
        spawn()
    while True:
        workers.discard(os.wait()[0])
        spawn()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--null-accept", action="store_true")
    parser.add_argument("--shape", choices=("event", "writev", "flat"), default="event")
    parser.add_argument("--pad", type=int, default=0)
    parser.add_argument("--events-per-writev", type=int, default=16)
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--connections-per-worker", type=int, default=1)
    args = parser.parse_args()
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    listener.listen(64)
    if args.workers:
        prefork(listener, args)
    else:
        accept_forever(listener, args)


if __name__ == "__main__":
    main()

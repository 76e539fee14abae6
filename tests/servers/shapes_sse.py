"""An SSE server whose accept and write shapes are chosen on the command line,
to reproduce what real servers do to the bytes the probes see.

Run: python shapes_sse.py PORT [--host ADDR] [--null-accept] [--shape event|writev|flat] [--pad N]

- --null-accept: accept4(fd, NULL, NULL, 0), as libuv and cpp-httplib do; the
  kernel is given no buffer for the peer's address.
- --shape event: one send() per SSE event, as one HTTP chunk.
  writev: 16 events per writev(), three iovecs each (chunk-size line, event,
  CRLF), as hyper and libuv coalesce them.
  flat: the whole body in one send() (20–40 KiB with --pad 2000), as a
  buffered server flushes it.
- --pad N: N bytes of generated text per event.

A POST's JSON body names max_tokens (events), id (the response id) and
optionally delay_ms (a pause before each event, with --shape event); every
stream ends with a usage event and [DONE]. Connections are kept alive."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import threading
import time

WRITEV_EVENTS = 16


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
    rid, n = request["id"], request["max_tokens"]
    out = []
    for i in range(n):
        text = f"t{i}-" + "x" * pad
        out.append(b"data: " + json.dumps({"id": rid, "model": "m", "choices": [
            {"index": 0, "text": text}]}).encode() + b"\n\n")
    out.append(b"data: " + json.dumps({"id": rid, "model": "m", "choices": [], "usage": {
        "prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def chunk(event: bytes) -> list[bytes]:
    return [b"%x\r\n" % len(event), event, b"\r\n"]


def respond(conn: socket.socket, request: dict, shape: str, pad: int) -> None:
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
        for start in range(0, len(body), WRITEV_EVENTS):
            iovecs = [part for event in body[start:start + WRITEV_EVENTS] for part in chunk(event)]
            total, sent = sum(map(len, iovecs)), os.writev(conn.fileno(), iovecs)
            if sent != total:  # a short write on a loopback socket: finish it flat
                conn.sendall(b"".join(iovecs)[sent:])
    conn.sendall(end)


def serve(conn: socket.socket, shape: str, pad: int) -> None:
    buf = bytearray()
    with conn:
        try:
            while (request := read_request(conn, buf)) is not None:
                respond(conn, request, shape, pad)
        except ConnectionError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--null-accept", action="store_true")
    parser.add_argument("--shape", choices=("event", "writev", "flat"), default="event")
    parser.add_argument("--pad", type=int, default=0)
    args = parser.parse_args()
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    listener.listen(64)
    while True:
        conn = accept_null(listener) if args.null_accept else listener.accept()[0]
        threading.Thread(target=serve, args=(conn, args.shape, args.pad), daemon=True).start()


if __name__ == "__main__":
    main()

"""A TLS SSE server on memory BIOs (as asyncio's ssl transport works) that
reads every ready socket before it feeds and runs any SSL object, so the
socket a thread read last is seldom the one whose SSL object runs next.

Run: python memory_bio_interleaved.py PORT CERT KEY; answers each POST with
5 SSE tokens, response id from the request body's "id"."""

from __future__ import annotations

import json
import select
import socket
import ssl
import sys

BUF = 65536


class Conn:
    def __init__(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.buf = bytearray(BUF)  # recv_into here, BIO_write from here: the bytes the probes follow
        self.received = 0
        self.request = b""
        self.handshaken = False

    def receive(self) -> bool:
        self.received = self.sock.recv_into(self.buf)
        return self.received > 0

    def process(self) -> None:
        self.incoming.write(memoryview(self.buf)[:self.received])
        if not self.handshaken:
            try:
                self.tls.do_handshake()
                self.handshaken = True
            except ssl.SSLWantReadError:
                pass
        if self.handshaken:
            try:
                while True:
                    self.request += self.tls.read(BUF)
            except ssl.SSLWantReadError:
                pass
            self.answer()
        self.flush()

    def answer(self) -> None:
        head, sep, rest = self.request.partition(b"\r\n\r\n")
        if not sep:
            return
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        if len(rest) < length:
            return
        rid = json.loads(rest[:length])["id"]
        self.request = rest[length:]
        self.tls.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(5):
            event = b"data: " + json.dumps({"id": rid, "model": "m", "choices": [{"text": f"t{i}"}]}).encode()
            event += b"\n\n"
            self.tls.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.tls.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")

    def flush(self) -> None:
        data = self.outgoing.read()
        if data:
            self.sock.sendall(data)


def main() -> None:
    port, cert, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", port))
    conns: dict[socket.socket, Conn] = {}
    while True:
        ready, _, _ = select.select([listener, *conns], [], [])
        if listener in ready:
            sock, _ = listener.accept()
            conns[sock] = Conn(sock, context)
            continue
        # Let the other connections' bytes arrive too, then read them all first.
        select.select([], [], [], 0.02)
        ready, _, _ = select.select(list(conns), [], [], 0)
        received = []
        for sock in ready:
            try:
                alive = conns[sock].receive()
            except ConnectionError:
                alive = False
            if alive:
                received.append(conns[sock])
            else:
                conns.pop(sock).sock.close()
        for conn in received:
            try:
                conn.process()
            except (ssl.SSLError, ConnectionError):
                conns.pop(conn.sock).sock.close()


if __name__ == "__main__":
    main()

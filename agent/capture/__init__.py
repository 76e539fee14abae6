"""Capture: from kernel events to one Exchange per HTTP request, in rooms by stage.

- kernel/          what the agent asks of the kernel: loads bpf/tokenprobe.c, attaches it, decodes its
                   ring-buffer records; BTF, headers, TLS library search, /proc, the clock
- wire/            bytes to HTTP exchanges: segments, HTTP/1.x framing and its connection assembler,
                   HTTP/2 and gRPC, SSE/NDJSON event streams, bodies, bounded byte samples
- dialects/        one module per API: what an event or body of that API means; the JSON scanner
- exchange.py      the Exchange record (one HTTP request and its response), close reasons, outcomes
- tracker.py       connections and their processes: kernel records in, each connection's assembler fed,
                   finished exchanges out
- inflight.py      what is in flight on each server now, from the tracker's open exchanges

The wire and the kernel rooms never import each other; the tracker joins them (pyproject's
import-linter contract holds the order).
"""

"""Capture: from kernel events to one Exchange per HTTP request.

- kernel/          loads bpf/tokenprobe.c, attaches it, decodes its ring-buffer records; BTF,
                   headers, TLS library search, /proc, the clock
- tracker.py       connections and their processes; feeds each connection's assembler

- exchange.py      the Exchange record, close reasons and outcomes
- http1.py         HTTP/1.x message framing of one direction, and which reader gets a body
- byte_samples.py  bounded head/tail samples of a byte stream, the request body fingerprint
- json_scan.py     reading fields out of bounded JSON samples (parse, or regex fallback)
- bodies.py        readers of a request body and of a whole JSON response
- sse.py           event-stream framing (SSE, NDJSON) and event timestamps
- dialects/        one module per API dialect: what an event or body of that API means
- assembler.py     HttpConnectionAssembler: both directions of one connection, the public API
"""

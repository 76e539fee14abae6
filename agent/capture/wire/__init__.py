"""The wire room: the bytes of a connection become HTTP exchanges.

- segments.py      a read()/write() as the probes saw it (head, gap, tail), checked
- assembler.py     HttpConnectionAssembler: both directions of one HTTP/1.x connection, paired in order
- http1.py         HTTP/1.x message framing of one direction, across segments and gaps
- http2.py, grpc.py HTTP/2 frames, HPACK and streams; gRPC messages and status
- bodies.py        request bodies, whole JSON responses, and which reader gets a response body
- sse.py           event-stream framing (SSE, NDJSON), event timestamps, steady templates
- byte_samples.py  bounded head/tail samples of a byte stream, the request body fingerprint
"""

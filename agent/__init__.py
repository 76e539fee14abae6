"""Kernel probes, event decoding, HTTP/SSE assembly, storage sink and the tokenprobe CLI."""

"""Capture: BPF loader, kernel events, connection tracking, HTTP/1 + SSE framing."""

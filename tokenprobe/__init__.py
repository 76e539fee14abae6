"""tokenprobe: eBPF observability for LLM inference serving.

The code lives in the repository's top-level rooms (agent/, bpf/, analytics/,
dashboard/, refserver/), installed as sub-packages of this namespace.
"""

__version__ = "0.1.0"

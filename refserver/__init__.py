"""Reference OpenAI-compatible streaming server and load generator, with a ground-truth log."""

from tokenprobe.refserver.engine import EngineSnapshot, EngineTiming
from tokenprobe.refserver.loadgen import (
    LoadConfig,
    LoadResult,
    LoadSummary,
    RequestRecord,
    burst,
    run_load,
)
from tokenprobe.refserver.server import ReferenceServer, RequestTrace, ServerConfig
from tokenprobe.refserver.tls import make_self_signed_cert

__all__ = [
    "EngineSnapshot",
    "EngineTiming",
    "LoadConfig",
    "LoadResult",
    "LoadSummary",
    "ReferenceServer",
    "RequestRecord",
    "RequestTrace",
    "ServerConfig",
    "burst",
    "make_self_signed_cert",
    "run_load",
]

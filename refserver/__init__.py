"""Reference OpenAI-compatible streaming server and load generator, with a ground-truth log."""

from .engine import EngineSnapshot, EngineTiming
from .loadgen import LoadConfig, LoadResult, LoadSummary, RequestRecord, burst, run_load
from .server import ReferenceServer, RequestTrace, ServerConfig
from .tls import make_self_signed_cert

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

"""The node agent's rooms: ``capture`` (kernel bytes → one record per request),
``sampling`` (GPU and engine state) and ``export`` (Prometheus, OTLP), plus
``doctor``. The process that wires them to the store is ``cli.agent``."""

"""The node agent's rooms: ``capture`` (kernel bytes → one record per request),
``sampling`` (GPU and engine state) and ``export`` (Prometheus, OTLP), plus
``doctor``. ``runner`` is the agent's loop with its stages named in one place;
``cli.agent`` only wires it to the store and the analytics, rooms above this one."""

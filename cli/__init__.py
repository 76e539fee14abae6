"""The `tokenprobe` command: the one room that wires the others together.

- ``main``: the command line and its subcommands.
- ``agent``: the agent process (capture → rows → store, sampling, exporters).
- ``demo``: the reference server under load, traced, behind the closed loop.
- ``stack``: actuator, gateway and control loop started in front of one server.
"""

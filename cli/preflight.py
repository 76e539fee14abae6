"""What `tokenprobe agent` checks before it compiles the probes (11–60 s): whatever would fail only after
that wait fails now, in one line, and whatever looks like a mistake but may be right is said, not refused.

- a metrics port another process holds: refused (the agent could not serve /metrics);
- a target port nothing listens on: a warning, and the agent waits for a server to listen;
- an executable that neither exists here nor runs: a warning (a container's path is matched as the container
  sees it, so it may start later, or only exist inside one).
"""

from __future__ import annotations

import errno
import logging
import os
import socket

from ..agent.capture.kernel.loader import Targets
from ..agent.capture.kernel.procfs import target_port_sockets

log = logging.getLogger("tokenprobe.agent")


class PreflightError(Exception):
    """A setting the agent cannot run with; the message names the fix."""


def check_metrics_port(host: str, port: int) -> None:
    """Raises PreflightError where ``host:port`` cannot be bound (in use, or an address not of this host)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the metrics server binds
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise PreflightError(f"--metrics-port {port}: {host}:{port} is in use by another process; choose "
                                     f"another port, or stop what listens there") from None
            raise PreflightError(f"--metrics-host {host} --metrics-port {port}: cannot listen there "
                                 f"({error.strerror})") from None


def warn_about_targets(targets: Targets) -> list[str]:
    """Logs a warning for each target that selects nothing yet; returns them (the tests read them)."""
    warnings = []
    if targets.ports:
        listening = {owner.local_port for owner in target_port_sockets(set(targets.ports))[0]}
        for port in sorted(set(targets.ports) - listening):
            warnings.append(f"nothing listens on port {port} yet: its connections are traced once a server "
                            f"listens there (check the port if none is about to)")
    running = _running_executables() if targets.exes else set()
    for exe in targets.exes:
        if not os.path.exists(exe) and exe not in running:
            warnings.append(f"--exe {exe}: no such file on this host and no process runs it: its processes are "
                            f"traced if one starts (inside a container, give the path the container sees)")
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


def _running_executables() -> set[str]:
    running = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                running.add(os.readlink(f"/proc/{entry}/exe"))
            except OSError:  # gone, or a kernel thread
                continue
    return running

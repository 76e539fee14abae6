"""The whole closed loop on one machine: actuator, gateway and control loop.

``closed_loop`` starts, in front of one inference server:

- the actuator (gRPC, in this process) with a fresh bearer token;
- the gateway (``python -m tokenprobe.actuator.proxy``) in its own process,
  as a real gateway would be: in this one it would compete with the caller
  for the GIL;
- the control loop, reading the agent's store and pushing its decisions to
  the actuator.

The demo, the end-to-end test and the control-loop benchmark all run this.
The store must be one an agent is writing (or will write) the server's
requests to; an embedded store is reached through its owning agent.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..actuator.auth import ClientAuth, ServerAuth
from ..actuator.controller import Controller, ControllerPolicy
from ..actuator.engine import Enforcer
from ..actuator.gateway import DEFAULT_DEADLINE_S
from ..actuator.loop import DEFAULT_SETTLE_S, ControlLoop
from ..actuator.publisher import DecisionPublisher
from ..actuator.server import ActuatorServer
from ..agent.runner import node_name
from ..analytics.figures import default_upstream
from ..store.embedded import open_store

GATEWAY_START_S = 30.0


@dataclass
class ClosedLoop:
    actuator: ActuatorServer
    loop: ControlLoop
    gateway_port: int
    upstream: str  # the server's name in decisions


@contextmanager
def closed_loop(store_url: str, *, server_port: int, gateway_port: int, workdir: Path,
                policy: ControllerPolicy = ControllerPolicy(), settle_s: float = DEFAULT_SETTLE_S,
                min_dwell_s: float | None = None,
                gateway_deadline_s: float = DEFAULT_DEADLINE_S) -> Iterator[ClosedLoop]:
    """Runs the loop for the server on 127.0.0.1:`server_port`, its gateway on `gateway_port`.

    `min_dwell_s`, the actuator's guard against flapping, defaults to half a
    window: the controller steps a breaker at most once a window, and a dwell
    as long as the window would refuse some of its steps by a hair."""
    if min_dwell_s is None:
        min_dwell_s = policy.window_s / 2
    token = secrets.token_urlsafe(32)
    upstream = default_upstream(node_name(), server_port)
    with ExitStack() as cleanup:
        actuator = ActuatorServer(ServerAuth(bearer_tokens=frozenset({token})),
                                  enforcer=Enforcer(min_dwell_s=min_dwell_s))
        actuator_port = actuator.start()
        cleanup.callback(actuator.stop)
        token_file = workdir / "actuator-token"
        token_file.touch(mode=0o600)
        token_file.write_text(token)
        gateway = subprocess.Popen([
            sys.executable, "-m", "tokenprobe.actuator.proxy", "--upstream-url", f"http://127.0.0.1:{server_port}",
            "--upstream", upstream, "--actuator", f"127.0.0.1:{actuator_port}", "--token-file", str(token_file),
            "--port", str(gateway_port), "--deadline", str(gateway_deadline_s),
            # The load generator's clients name their tenants by header and hold no API keys.
            "--trust-tenant-header"])
        cleanup.callback(stop_process, gateway)
        _wait_listening(gateway, gateway_port)

        store = open_store(store_url, serve=False)
        cleanup.callback(store.close)
        store.ensure_schema()  # tokenprobe.decisions is the controller's table, not the agent's
        publisher = DecisionPublisher(f"127.0.0.1:{actuator_port}", ClientAuth(bearer_token=token))
        cleanup.callback(publisher.close)
        loop = ControlLoop(store, publisher, Controller(policy), settle_s=settle_s).start()
        cleanup.callback(loop.stop)
        yield ClosedLoop(actuator, loop, gateway_port, upstream)


def _wait_listening(process: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + GATEWAY_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise OSError(f"the gateway exited with code {process.returncode} (is port {port} free?)")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)
    raise OSError(f"the gateway did not listen on port {port} within {GATEWAY_START_S:.0f} s")


def stop_process(process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Ask a child process to stop; kill it if it has not within ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

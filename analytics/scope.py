"""Which servers and models an analysis covers, as a SQL condition with bound parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Server:
    """A server is its port, on one node or (node None) on every node."""

    port: int
    node: str | None = None

    @classmethod
    def parse(cls, text: str) -> Server:
        """"8000" or "node-a:8000"."""
        node, _, port = text.strip().rpartition(":")
        try:
            number = int(port)
        except ValueError:
            raise ValueError(f"server {text!r}: give a port (8000) or node:port (gpu-node-1:8000)") from None
        if not 0 < number < 65536:
            raise ValueError(f"server {text!r}: port must be 1..65535")
        return cls(number, node or None)

    def __str__(self) -> str:
        return f"{self.node}:{self.port}" if self.node else str(self.port)


@dataclass(frozen=True)
class Scope:
    """Empty tuples mean every server and every model."""

    servers: tuple[Server, ...] = ()
    models: tuple[str, ...] = ()

    def condition(self, *, with_model: bool = True) -> tuple[str, dict[str, Any]]:
        """A SQL condition on columns ``node``, ``server_port`` (and ``model``) and its parameters.

        ``with_model=False`` for tables that have no model column (GPU samples).
        """
        clauses, parameters = [], {}
        if self.servers:
            alternatives = []
            for index, server in enumerate(self.servers):
                parameters[f"scope_port_{index}"] = server.port
                clause = f"server_port = {{scope_port_{index}:UInt16}}"
                if server.node:
                    parameters[f"scope_node_{index}"] = server.node
                    clause += f" AND node = {{scope_node_{index}:String}}"
                alternatives.append(f"({clause})")
            clauses.append("(" + " OR ".join(alternatives) + ")")
        if self.models and with_model:
            parameters["scope_models"] = list(self.models)
            clauses.append("model IN {scope_models:Array(String)}")
        return (" AND ".join(clauses) or "1"), parameters


EVERYTHING = Scope()

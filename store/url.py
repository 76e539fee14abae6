"""Store URLs: ``chdb:///DIR`` (embedded) or ``http(s)://[user:pass@]host[:port]/`` (a server)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

logger = logging.getLogger(__name__)

from ..contract.tables import DEFAULT_DATABASE

# The store URL may carry a password: TOKENPROBE_STORE keeps it off command lines.
DEFAULT_STORE = os.environ.get("TOKENPROBE_STORE", "chdb:///var/lib/tokenprobe/store")
DEFAULT_HTTP_PORT = 8123
DEFAULT_HTTPS_PORT = 8443


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL. ``kind`` is "embedded" (``path`` set) or "server"."""

    kind: str
    database: str
    path: str = ""
    scheme: str = ""
    host: str = ""
    port: int = 0
    username: str = ""
    password: str = ""
    proxy_path: str = ""

    def display(self) -> str:
        """The URL without its password, for messages and logs."""
        if self.kind == "embedded":
            return f"chdb://{self.path}"
        user = f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{user}{host}:{self.port}/{self.proxy_path}"


def parse_store_url(url: str) -> StoreURL:
    """Parse a store URL (see the module docstring); ValueError says what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("store URL is empty: give chdb:///DIR, a directory path, or http(s)://host:port/")
    url = url.strip()
    if "://" not in url:
        return StoreURL("embedded", DEFAULT_DATABASE, path=_directory(url))
    scheme = url.split("://", 1)[0].lower()
    if scheme == "chdb":
        location, _, query = url.split("://", 1)[1].partition("?")
        if not location:
            raise ValueError(f"store URL {url!r} names no directory: use chdb:///abs/dir or chdb://./rel/dir")
        return StoreURL("embedded", _database_parameter(query, url), path=_directory(unquote(location)))
    if scheme in ("http", "https"):
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"store URL {_redact(url)!r} has an invalid port") from None
        if not parts.hostname:
            raise ValueError(f"store URL {_redact(url)!r} names no host")
        return StoreURL(
            "server",
            _database_parameter(parts.query, _redact(url)),
            scheme=scheme,
            host=parts.hostname,
            port=port or (DEFAULT_HTTPS_PORT if scheme == "https" else DEFAULT_HTTP_PORT),
            username=unquote(parts.username or "default"),
            password=unquote(parts.password or ""),
            proxy_path=parts.path.strip("/"),
        )
    raise ValueError(
        f"unsupported store URL scheme {scheme!r} in {_redact(url)!r}: "
        "use chdb:///DIR, a directory path, http://host:8123/ or https://host:8443/"
    )


def _directory(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def _database_parameter(query: str, url: str) -> str:
    try:
        parameters = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"store URL {url!r} has a malformed query string") from None
    unknown = set(parameters) - {"database"}
    if unknown:
        raise ValueError(
            f"store URL {url!r} has unknown parameter(s) {sorted(unknown)}; only 'database' is accepted"
        )
    database = parameters.get("database", [DEFAULT_DATABASE])[-1]
    if not database.isidentifier():
        raise ValueError(f"store URL {url!r}: database {database!r} is not a plain identifier")
    return database


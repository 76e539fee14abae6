"""The store: ClickHouse, embedded (chDB) or a server, behind one client.

- ``url``: store URLs; ``embedded``: the directory's owner and ``open_store``;
  ``client``: ``Store``, the one API for both kinds; ``rows``: typed rows;
  ``server``: the owner's ClickHouse HTTP interface for other processes;
  ``sink`` and ``spool``: the agent's batched writer, spooling through outages;
  ``schema``: views created beside the registered tables.

Table definitions live in ``contract``; this room creates and fills them.
"""

from .client import Store, StoreUnavailable
from .embedded import open_store
from .url import StoreURL, parse_store_url

__all__ = ["Store", "StoreURL", "StoreUnavailable", "open_store", "parse_store_url"]

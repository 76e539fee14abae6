"""Fixtures shared by the store's test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenprobe.store import open_store


@pytest.fixture
def store_dir(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def owner(store_dir):
    store = open_store(f"chdb://{store_dir}")
    store.ensure_schema()
    yield store
    store.close()

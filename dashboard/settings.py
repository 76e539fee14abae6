"""How ``tokenprobe dashboard`` hands its settings to the Streamlit app: environment variables.

Streamlit runs the app script in its own process; the variables survive that
hop unchanged and work the same under ``streamlit run`` and Streamlit's AppTest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..store.url import DEFAULT_STORE

STORE_ENV = "TOKENPROBE_DASHBOARD_STORE"
REFRESH_ENV = "TOKENPROBE_DASHBOARD_REFRESH_S"
OWN_STORE_ENV = "TOKENPROBE_DASHBOARD_OWN_STORE"
DEFAULT_REFRESH_S = 10.0


@dataclass(frozen=True)
class DashboardSettings:
    store_url: str
    refresh_s: float  # 0: no auto-refresh
    own_store: bool = False  # open an embedded store nobody owns (and hold it), rather than refuse


def parse_refresh(text: str) -> float:
    """Seconds between refreshes: a number >= 0 (0 turns auto-refresh off). ValueError says what is wrong."""
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"refresh must be a number of seconds, got {text!r}") from None
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"refresh must be >= 0 seconds (0 turns it off), got {text!r}")
    return seconds


def environment(store_url: str, refresh_s: float, own_store: bool = False) -> dict[str, str]:
    """The variables that carry these settings to the app."""
    return {STORE_ENV: store_url, REFRESH_ENV: repr(refresh_s), OWN_STORE_ENV: "1" if own_store else ""}


def from_environment() -> DashboardSettings:
    """The settings the app was started with (the CLI's defaults where a variable is unset)."""
    return DashboardSettings(
        store_url=os.environ.get(STORE_ENV, DEFAULT_STORE),
        refresh_s=parse_refresh(os.environ.get(REFRESH_ENV, str(DEFAULT_REFRESH_S))),
        own_store=bool(os.environ.get(OWN_STORE_ENV)),
    )

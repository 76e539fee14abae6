"""Time ranges: what the analytics are asked about, and how people write them."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

NS_PER_S = 1_000_000_000
_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)\s*([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class TimeRange:
    """[start_ns, end_ns) in Unix-epoch nanoseconds."""

    start_ns: int
    end_ns: int

    def __post_init__(self) -> None:
        if self.end_ns <= self.start_ns:
            raise ValueError(f"empty time range: {format_ns(self.start_ns)} is not before {format_ns(self.end_ns)}")

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S

    def whole_steps(self, step_ns: int) -> TimeRange | None:
        """The whole steps of ``step_ns`` (counted from the epoch: a rollup's minutes) within this range; None
        where not one fits."""
        start_ns, end_ns = -(-self.start_ns // step_ns) * step_ns, self.end_ns // step_ns * step_ns
        return TimeRange(start_ns, end_ns) if start_ns < end_ns else None

    def extended_back(self, seconds: float) -> TimeRange:
        return TimeRange(self.start_ns - int(seconds * NS_PER_S), self.end_ns)

    def ending_span(self, seconds: float) -> TimeRange:
        """The ``seconds`` before this range's end."""
        return TimeRange(self.end_ns - int(seconds * NS_PER_S), self.end_ns)


def parse_time(text: str, now_ns: int | None = None) -> int:
    """A time as Unix-epoch ns from: "now"; a span ago ("15m", "-2h", "90s", "1d"); Unix seconds;
    or ISO 8601 ("2026-11-30T10:00:00Z", an offset, or no zone meaning UTC)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    value = text.strip()
    if value.lower() == "now":
        return now_ns
    relative = _RELATIVE.match(value.lower())
    if relative:
        return now_ns - int(float(relative.group(1)) * _UNIT_S[relative.group(2)] * NS_PER_S)
    try:
        return int(float(value) * NS_PER_S)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"cannot read the time {text!r}: give 'now', a span ago such as 15m, 2h or 1d, "
            "Unix seconds, or ISO 8601 such as 2026-11-30T10:00:00Z"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp()) * NS_PER_S + moment.microsecond * 1000


def format_ns(ns: int) -> str:
    """UTC, to the second, for people."""
    return datetime.fromtimestamp(ns / NS_PER_S, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def range_condition(column: str, name: str, time_range: TimeRange) -> tuple[str, dict[str, int]]:
    """``column`` within ``time_range`` as SQL, with its parameters named after ``name``."""
    sql = (f"{column} >= fromUnixTimestamp64Nano({{{name}_from:Int64}}, 'UTC') "
           f"AND {column} < fromUnixTimestamp64Nano({{{name}_to:Int64}}, 'UTC')")
    return sql, {f"{name}_from": time_range.start_ns, f"{name}_to": time_range.end_ns}

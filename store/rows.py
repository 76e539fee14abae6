"""Typed rows: checking row dicts against a table's ClickHouse types and turning them into Arrow."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class _ColumnType:
    """How one ClickHouse column type is checked in Python and carried in Arrow."""

    arrow: pa.DataType
    accepts: Callable[[Any], bool]
    expected: str
    nullable: bool


def _int_between(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_INTEGER_BITS = {"8": 8, "16": 16, "32": 32, "64": 64}
_TIMESTAMP_UNITS = {0: "s", 3: "ms", 6: "us", 9: "ns"}
_SIMPLE_TYPES = {
    "String": (pa.string(), lambda value: isinstance(value, str), "a str"),
    "Bool": (pa.bool_(), lambda value: isinstance(value, bool), "a bool"),
    "Float32": (pa.float32(), _is_number, "a number"),
    "Float64": (pa.float64(), _is_number, "a number"),
}


def _column_type(ch_type: str) -> _ColumnType:
    """Map a ClickHouse type name (as system.columns prints it) to its Python check and Arrow type."""
    nullable = ch_type.startswith("Nullable(")
    base = ch_type[len("Nullable("):-1] if nullable else ch_type
    if base.startswith("LowCardinality("):
        inner = _column_type(base[len("LowCardinality("):-1])
        return _ColumnType(inner.arrow, inner.accepts, inner.expected, nullable or inner.nullable)
    if base.startswith("Array("):
        element = _column_type(base[len("Array("):-1])
        return _ColumnType(
            pa.list_(element.arrow),
            lambda value: isinstance(value, (list, tuple)) and all(element.accepts(item) for item in value),
            f"a list of {element.expected}",
            nullable,
        )
    for prefix, signed in (("UInt", False), ("Int", True)):
        bits = _INTEGER_BITS.get(base[len(prefix):]) if base.startswith(prefix) else None
        if bits:
            low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
            arrow = getattr(pa, f"{'int' if signed else 'uint'}{bits}")()
            return _ColumnType(arrow, _int_between(low, high), f"an int in [{low}, {high})", nullable)
    if base.startswith("DateTime64("):
        precision = int(base[len("DateTime64("):].split(",")[0].rstrip(")"))
        if precision not in _TIMESTAMP_UNITS:
            raise ValueError(f"cannot carry {ch_type} in Arrow (precision must be 0, 3, 6 or 9)")
        unit = _TIMESTAMP_UNITS[precision]
        # Arrow timestamps are 64-bit counts of the unit since the epoch.
        return _ColumnType(pa.timestamp(unit, tz="UTC"), _int_between(-(1 << 63), 1 << 63),
                           f"an int ({unit} since the epoch)", nullable)
    if base in _SIMPLE_TYPES:
        arrow, accepts, expected = _SIMPLE_TYPES[base]
        return _ColumnType(arrow, accepts, expected, nullable)
    raise ValueError(
        f"cannot convert Python values to ClickHouse type {ch_type}; build an Arrow table and use insert_arrow"
    )


def _describe(value: Any) -> str:
    """A value for an error message: numbers as they are, anything else by type only (it may be user text)."""
    return repr(value) if _is_number(value) or isinstance(value, bool) else type(value).__name__


class RowSchema:
    """Checks row dicts against a table's columns and turns batches of them into Arrow tables.

    Columns that may be missing from a row: Nullable ones (written as NULL) and
    ``optional`` ones, which have a server-side default and are left out of a
    batch when no row in it carries them.
    """

    def __init__(self, column_types: Mapping[str, str], optional: Sequence[str] = ()):
        self.types = {name: _column_type(ch_type) for name, ch_type in column_types.items()}
        self._optional = frozenset(optional)
        self._required = [
            name for name, column in self.types.items() if not column.nullable and name not in self._optional
        ]

    def check(self, row: Mapping[str, Any]) -> None:
        """Raise ValueError naming the first bad column of ``row``."""
        if not isinstance(row, Mapping):
            raise ValueError(f"a row must be a dict, not {type(row).__name__}")
        for name, value in row.items():
            column = self.types.get(name)
            if column is None:
                raise ValueError(f"unknown column {name!r}")
            if value is None:
                if not column.nullable:
                    raise ValueError(f"column {name!r} cannot be None")
            elif not column.accepts(value):
                raise ValueError(f"column {name!r} must be {column.expected}, got {_describe(value)}")
        missing = [name for name in self._required if name not in row]
        if missing:
            raise ValueError(f"row lacks required column(s) {missing}")

    def to_arrow(self, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
        names = [
            name for name in self.types
            if name not in self._optional or any(name in row for row in rows)
        ]
        arrays = []
        for name in names:
            try:
                arrays.append(pa.array([row.get(name) for row in rows], type=self.types[name].arrow))
            except (pa.ArrowException, OverflowError, TypeError) as error:
                raise ValueError(f"column {name!r}: {error}") from None
        return pa.Table.from_arrays(arrays, names=names)



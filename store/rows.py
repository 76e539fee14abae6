"""Typed rows: checking row dicts against a table's ClickHouse types and turning them into Arrow."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Any

import pyarrow as pa

logger = logging.getLogger(__name__)

# Row shapes (column names and value types) whose checks RowSchema keeps; past this many it starts afresh.
_MAX_ROW_SHAPES = 256


@dataclass(frozen=True)
class _ColumnType:
    """How one ClickHouse column type is checked in Python and carried in Arrow."""

    arrow: pa.DataType
    accepts: Callable[[Any], bool]
    expected: str
    nullable: bool
    # For checking whole rows at C speed: the Python types a value may have exactly (a subclass
    # goes to `accepts`), the [low, high) an int must lie in, and an array's element type.
    exact_types: frozenset[type] = frozenset()
    bounds: tuple[int, int] | None = None
    element: _ColumnType | None = None


def _int_between(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_INTEGER_BITS = {"8": 8, "16": 16, "32": 32, "64": 64}
_TIMESTAMP_UNITS = {0: "s", 3: "ms", 6: "us", 9: "ns"}
_INT = frozenset((int,))  # bool is a subclass, never the exact type
_SIMPLE_TYPES = {
    "String": (pa.string(), lambda value: isinstance(value, str), "a str", frozenset((str,))),
    "Bool": (pa.bool_(), lambda value: isinstance(value, bool), "a bool", frozenset((bool,))),
    "Float32": (pa.float32(), _is_number, "a number", frozenset((int, float))),
    "Float64": (pa.float64(), _is_number, "a number", frozenset((int, float))),
}


def _column_type(ch_type: str) -> _ColumnType:
    """Map a ClickHouse type name (as system.columns prints it) to its Python check and Arrow type."""
    nullable = ch_type.startswith("Nullable(")
    base = ch_type[len("Nullable("):-1] if nullable else ch_type
    if base.startswith("LowCardinality("):
        inner = _column_type(base[len("LowCardinality("):-1])
        return replace(inner, nullable=nullable or inner.nullable)
    if base.startswith("Array("):
        element = _column_type(base[len("Array("):-1])
        return _ColumnType(
            pa.list_(element.arrow),
            lambda value: isinstance(value, (list, tuple)) and all(element.accepts(item) for item in value),
            f"a list of {element.expected}",
            nullable,
            frozenset((list, tuple)),
            element=element,
        )
    for prefix, signed in (("UInt", False), ("Int", True)):
        bits = _INTEGER_BITS.get(base[len(prefix):]) if base.startswith(prefix) else None
        if bits:
            low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
            arrow = getattr(pa, f"{'int' if signed else 'uint'}{bits}")()
            return _ColumnType(arrow, _int_between(low, high), f"an int in [{low}, {high})", nullable,
                               _INT, (low, high))
    if base.startswith("DateTime64("):
        precision = int(base[len("DateTime64("):].split(",")[0].rstrip(")"))
        if precision not in _TIMESTAMP_UNITS:
            raise ValueError(f"cannot carry {ch_type} in Arrow (precision must be 0, 3, 6 or 9)")
        unit = _TIMESTAMP_UNITS[precision]
        # Arrow timestamps are 64-bit counts of the unit since the epoch.
        return _ColumnType(pa.timestamp(unit, tz="UTC"), _int_between(-(1 << 63), 1 << 63),
                           f"an int ({unit} since the epoch)", nullable, _INT, (-(1 << 63), 1 << 63))
    if base in _SIMPLE_TYPES:
        arrow, accepts, expected, exact_types = _SIMPLE_TYPES[base]
        return _ColumnType(arrow, accepts, expected, nullable, exact_types)
    raise ValueError(
        f"cannot convert Python values to ClickHouse type {ch_type}; build an Arrow table and use insert_arrow"
    )


def _describe(value: Any) -> str:
    """A value for an error message: numbers as they are, anything else by type only (it may be user text)."""
    return repr(value) if _is_number(value) or isinstance(value, bool) else type(value).__name__


@dataclass(frozen=True)
class _ShapeCheck:
    """The checks left for rows of one shape once their value types passed: int ranges, taken a
    group of columns at a time, and arrays' element types and ranges."""

    possible: bool  # False: rows of this shape are checked value by value
    ints: list[tuple[Callable[[Mapping], tuple], int, int]]
    arrays: list[tuple[str, frozenset[type], tuple[int, int] | None]]

    def passes(self, row: Mapping[str, Any]) -> bool:
        if not self.possible:
            return False
        for values, low, high in self.ints:
            group = values(row)
            if min(group) < low or max(group) >= high:
                return False
        for name, element_types, bounds in self.arrays:
            items = row[name]
            if items and not (set(map(type, items)) <= element_types
                              and (bounds is None or bounds[0] <= min(items) and max(items) < bounds[1])):
                return False
        return True


_CHECK_EACH_VALUE = _ShapeCheck(False, [], [])


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
        self._required_set = frozenset(self._required)
        self._shape_checks: dict[tuple[tuple[str, ...], tuple[type, ...]], _ShapeCheck] = {}

    def check(self, row: Mapping[str, Any]) -> None:
        """Raise ValueError naming the first bad column of ``row``.

        A row of a shape seen before (its column names and value types) is checked whole, in a few
        C-level passes (the agent checks every row it writes, some with thousands of token offsets);
        one those do not pass, or of a shape they cannot judge, is checked value by value, which
        accepts or refuses it and names the column."""
        if type(row) is dict:
            shape = (tuple(row), tuple(map(type, row.values())))
            check = self._shape_checks.get(shape)
            if check is None:
                if len(self._shape_checks) >= _MAX_ROW_SHAPES:
                    self._shape_checks.clear()
                check = self._shape_checks[shape] = self._shape_check(*shape)
            if check.passes(row):
                return
        self._check_each(row)

    def _shape_check(self, names: tuple[str, ...], kinds: tuple[type, ...]) -> _ShapeCheck:
        """What is left to check of rows with these column names and value types: the ints' ranges."""
        bounded: dict[tuple[int, int], list[str]] = {}
        arrays = []
        for name, kind in zip(names, kinds):
            column = self.types.get(name)
            if column is None or (kind not in column.exact_types and not (kind is type(None) and column.nullable)):
                return _CHECK_EACH_VALUE
            element = column.element
            if kind is type(None):
                continue
            if element is not None:
                if element.element is not None:
                    return _CHECK_EACH_VALUE  # arrays of arrays: value by value
                arrays.append((name, element.exact_types, element.bounds))
            elif column.bounds is not None:
                bounded.setdefault(column.bounds, []).append(name)
        if not self._required_set.issubset(names):
            return _CHECK_EACH_VALUE
        # One name more than needed: itemgetter of a single name returns the value, not a tuple.
        ints = [(itemgetter(*group, group[0]), low, high) for (low, high), group in bounded.items()]
        return _ShapeCheck(True, ints, arrays)

    def _check_each(self, row: Mapping[str, Any]) -> None:
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



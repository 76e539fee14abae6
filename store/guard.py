"""What each credential of the embedded store's HTTP interface may run, judged on the engine's own parse.

chDB has no users or grants of its own, and the store's owner is the agent, which runs as root: a
statement that reaches a file, a URL, another server or a program would do so with root's rights.
So the server judges every statement before it runs, by allow-list, on what ClickHouse's own parser
and analyzer make of it (no quoting, comment or case trick reads differently here and at execution):

- One statement per request: ``formatQuerySingleLine`` parses the text handed to it as a bind
  parameter (so nothing of it runs) and refuses a second statement. ``EXPLAIN AST`` alone would not
  do: given ``SELECT 1; INSERT INTO FUNCTION file(...)`` it explains the first and *runs* the second.
- The reader: a SELECT (or a DESCRIBE), whose every table (``EXPLAIN QUERY TREE``, which resolves CTEs, ``IN table``
  and subqueries) is in the project's database or one of a few system tables of metadata.
- The writer: a SELECT or DESCRIBE as above; an INSERT into a table of the project's database; the DDL that
  ``Store.ensure_schema`` sends (CREATE DATABASE, CREATE TABLE with a MergeTree-family or Null engine,
  CREATE [MATERIALIZED] VIEW, ALTER TABLE ... ADD COLUMN / MODIFY SETTING, DROP VIEW) in that
  database; EXISTS.
- Both: no table function but a few that make rows from nothing (``numbers``, ``values``, ...): the
  check is on every function of the tree whose name is a table function's, so ``file()`` is refused
  as a scalar too; no INFILE / OUTFILE; no setting that names a file, a schema or a URL.

Nothing else (KILL, SET, SYSTEM, ATTACH, BACKUP, DICTIONARY, other databases, ...) is served.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# Table functions that make rows from their arguments alone: no file, network, table or program.
ALLOWED_TABLE_FUNCTIONS = frozenset({"numbers", "numbers_mt", "zeros", "zeros_mt", "values", "generate_series",
                                     "generateseries", "format", "null"})
# The engines the project's tables use (contract/): data in the store's own directory, or nowhere.
ALLOWED_ENGINES = frozenset({"MergeTree", "ReplacingMergeTree", "SummingMergeTree", "AggregatingMergeTree", "Null"})
# System tables of metadata that clients read (clickhouse-connect reads system.settings at connect).
ALLOWED_SYSTEM_TABLES = frozenset({"one", "numbers", "numbers_mt", "zeros", "zeros_mt", "tables", "columns",
                                   "settings", "databases", "functions", "table_functions", "time_zones",
                                   "data_type_families"})
ALTER_COMMANDS = frozenset({"ADD_COLUMN", "MODIFY_SETTING"})
# Settings that make the engine read or write a file, or reach a URL (a schema file, a template, an
# error log, a schema registry, OUTFILE's directories): never taken from a client.
REACHING_SETTING = re.compile(r"schema|template|file|registry|outfile|_path|url")

_FUNCTION = re.compile(r"^\s*(?:Function|FunctionWithKeyValueArguments)\s+(\w+)", re.MULTILINE)
_TABLE_IDENTIFIER = re.compile(r"^\s*TableIdentifier\s+(\S+)", re.MULTILINE)
_QUERY_TREE_TABLE = re.compile(r"\btable_name:\s*([^,\s]+)")
_QUERY_TREE_TABLE_FUNCTION = re.compile(r"\btable_function_name:\s*([^,\s]+)")
_ROOT_CHILD = re.compile(r"^ (\w[\w ]*?)(?: \(children \d+\))?$", re.MULTILINE)
_ROOT_IDENTIFIER = re.compile(r"^ Identifier (\S+)$", re.MULTILINE)
_ENGINE = re.compile(r"^ Storage definition.*\n  Function (\w+)", re.MULTILINE)
_ALTER_COMMAND = re.compile(r"^  AlterCommand (\w+)", re.MULTILINE)
# A literal right under a query's root is its INFILE / OUTFILE name (or that file's compression).
_ROOT_LITERAL = re.compile(r"^ Literal ", re.MULTILINE)
_FILE_ROOTS = ("InsertQuery", "SelectWithUnionQuery", "Show", "Explain", "Describe")
_WORD = re.compile(r"\w+")
# The engine's single-line text of a statement ends with its FORMAT clause, if it has one.
_FORMAT_CLAUSE = re.compile(r" FORMAT \w+$")


class Refused(Exception):
    """The statement is not one this credential may run; the message says why."""


class StatementGuard:
    """Judges statements for the store's reader and writer credentials (see the module docstring).

    ``table_functions`` and ``settings`` are the engine's own names (``system.table_functions``,
    ``system.settings``); ``database`` is the project's database, the only one a client may touch.
    """

    def __init__(self, database: str, table_functions: Iterable[str], settings: Iterable[str]):
        self.database = database
        self._refused_functions = frozenset(name.lower() for name in table_functions) - ALLOWED_TABLE_FUNCTIONS
        self.reaching_settings = frozenset(name for name in settings if REACHING_SETTING.search(name))

    def judge(self, connection, sql: str, bind_params: Mapping[str, str], *, reader: bool,
              data_apart: bool = False) -> str:
        """The statement to run for ``sql``: the engine's own single-line text of it, once judged one statement
        this credential may run (else Refused). ``data_apart``: ``sql`` is the head of an INSERT whose data the
        server reads apart. Engine errors (a syntax error) pass through."""
        canonical = connection.query("SELECT formatQuerySingleLine({statement:String})", "RawBLOB",
                                     params={"statement": _escaped(sql)}).bytes().decode()
        # Explained without its FORMAT clause, which would print the explanation in that format (an INSERT's
        # names its data's format, and stays).
        explained = canonical if canonical.startswith("INSERT ") else _FORMAT_CLAUSE.sub("", canonical)
        tree = connection.query("EXPLAIN AST " + explained, "TabSeparated", params=bind_params).bytes().decode()
        kind = tree.split(maxsplit=1)[0] if tree.strip() else ""
        reached = {name.lower() for name in _FUNCTION.findall(tree)} & self._refused_functions
        if reached:
            raise Refused(f"{sorted(reached)[0]}() reaches outside the store")
        if tree.startswith(_FILE_ROOTS) and _ROOT_LITERAL.search(tree):
            raise Refused("the store does not read or write files (INFILE, OUTFILE)")
        named = set(_WORD.findall(canonical)) & self.reaching_settings
        if named:
            raise Refused(f"the setting {sorted(named)[0]} reaches a file or URL")
        for table in _TABLE_IDENTIFIER.findall(tree):
            self._check_table(table, qualified_only=False)
        if kind == "InsertQuery" and not data_apart and _FORMAT_CLAUSE.search(canonical):
            # The engine's text of it leaves the data out, and the engine would run what follows it after a `;`.
            raise Refused("an INSERT's data follows FORMAT <format> or VALUES at the head of the statement")
        if kind == "SelectWithUnionQuery":
            self._check_tables_read(connection, explained, bind_params)
        elif kind == "DescribeQuery":
            pass  # a table's columns (clickhouse-connect asks before an insert); its tables are checked above
        elif reader:
            raise Refused(f"the reader's credential runs SELECT only, not {_statement_name(canonical)}")
        else:
            self._judge_write(kind, canonical, tree)
        return canonical

    def _check_tables_read(self, connection, sql: str, bind_params: Mapping[str, str]) -> None:
        """Every table the analyzer resolves (CTEs, IN, subqueries, views' callers) is the project's."""
        tree = connection.query("EXPLAIN QUERY TREE " + sql, "TabSeparated", params=bind_params).bytes().decode()
        for table in _QUERY_TREE_TABLE.findall(tree):
            self._check_table(table, qualified_only=True)
        for function in _QUERY_TREE_TABLE_FUNCTION.findall(tree):
            if function.lower() not in ALLOWED_TABLE_FUNCTIONS:
                raise Refused(f"{function}() reaches outside the store")

    def _check_table(self, name: str, *, qualified_only: bool) -> None:
        database, dot, table = name.partition(".")
        if not dot:
            if qualified_only:
                raise Refused(f"table {name} is not named with its database")
            return  # a CTE's name, or a table of the request's database (which must be the project's)
        if database == self.database or (database == "system" and table in ALLOWED_SYSTEM_TABLES):
            return
        raise Refused(f"table {name} is outside the store's database {self.database}")

    def _judge_write(self, kind: str, canonical: str, tree: str) -> None:
        identifiers = _ROOT_IDENTIFIER.findall(tree)
        if kind == "ExistsTableQuery":
            return
        if kind == "InsertQuery":
            if not identifiers:
                raise Refused("an INSERT names a table of the store")
            self._check_target(identifiers, table_named=True)
            return
        if kind == "CreateQuery":
            self._judge_create(canonical, tree, identifiers)
            return
        if kind == "AlterQuery":
            commands = set(_ALTER_COMMAND.findall(tree))
            if not commands or commands - ALTER_COMMANDS:
                raise Refused(f"ALTER TABLE may only {' / '.join(sorted(ALTER_COMMANDS))}")
            self._check_target(identifiers, table_named=True)
            return
        if kind == "DropQuery" and canonical.startswith("DROP VIEW "):
            self._check_target(identifiers, table_named=True)
            return
        raise Refused(f"the writer's credential does not run {_statement_name(canonical)}")

    def _judge_create(self, canonical: str, tree: str, identifiers: list[str]) -> None:
        children = set(_ROOT_CHILD.findall(tree))
        engines = _ENGINE.findall(tree)
        if engines and engines[0] not in ALLOWED_ENGINES:
            raise Refused(f"the engine {engines[0]} is not one the store's tables use")
        if canonical.startswith("CREATE DATABASE ") and not engines:
            self._check_target(identifiers, table_named=False)
        elif canonical.startswith("CREATE TABLE ") and engines and "Columns definition" in children:
            self._check_target(identifiers, table_named=True)
        elif canonical.startswith(("CREATE VIEW ", "CREATE OR REPLACE VIEW ", "CREATE MATERIALIZED VIEW ")) \
                and "SelectWithUnionQuery" in children:
            self._check_target(identifiers, table_named=True)
        else:
            raise Refused(f"the writer's credential does not run {_statement_name(canonical)}")

    def _check_target(self, identifiers: list[str], *, table_named: bool) -> None:
        """The database a statement writes or defines in, named explicitly, is the project's."""
        if len(identifiers) < (2 if table_named else 1) or identifiers[0] != self.database:
            raise Refused(f"a statement that writes names a table of the store's database {self.database} "
                          f"with the database")


def _escaped(value: str) -> str:
    """``value`` as a query parameter's text, which the engine reads with TSV escapes."""
    return value.translate({ord("\\"): "\\\\", ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r",
                            ord("\0"): "\\0"})


def _statement_name(canonical: str) -> str:
    words = canonical.split()
    return " ".join(words[:2]) if words else "an empty statement"

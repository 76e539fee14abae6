"""docs/servers.md's table is the server matrix's own list, rendered
(tests/server_matrix.py, by scripts/render_docs.py); the kernel matrix asserts that list stack by stack,
and each other line names a test that exists."""

from __future__ import annotations

from pathlib import Path

from tests.server_matrix import (
    SHOWN_ELSEWHERE,
    STACKS,
    TABLE_BEGIN,
    TABLE_END,
    matrix_table,
)

REPO = Path(__file__).parent.parent
SERVERS_PAGE = REPO / "docs" / "servers.md"


def test_servers_page_table_is_the_matrix():
    text = SERVERS_PAGE.read_text()
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    assert 0 <= start < end, f"docs/servers.md lacks the section between {TABLE_BEGIN!r} and {TABLE_END!r}"
    assert text[start:end + len(TABLE_END)] == matrix_table(), (
        "docs/servers.md's server matrix differs from tests/server_matrix.py: "
        "run .venv/bin/python scripts/render_docs.py")


def test_every_stack_is_launched_by_the_kernel_matrix():
    from tests.test_kernel_matrix import LAUNCHES

    assert sorted(LAUNCHES) == sorted(s.key for s in STACKS)


def test_every_other_line_names_a_test_that_exists():
    for shown in SHOWN_ELSEWHERE:
        path, name = shown.test.split("::")
        assert f"\ndef {name}(" in (REPO / path).read_text(), f"{shown.test} is not a test"

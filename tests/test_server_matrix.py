"""The README's "What is read" table is the server matrix's own list, rendered
(tests/server_matrix.py); the kernel matrix asserts that list stack by stack,
and each other line names a test that exists."""

from __future__ import annotations

from pathlib import Path

from tests.server_matrix import README_BEGIN, README_END, SHOWN_ELSEWHERE, STACKS, readme_table

REPO = Path(__file__).parent.parent
README = REPO / "README.md"


def test_readme_table_is_the_matrix():
    text = README.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    assert 0 <= start < end, f"README.md lacks the section between {README_BEGIN!r} and {README_END!r}"
    assert text[start:end + len(README_END)] == readme_table(), (
        "README.md's server matrix differs from tests/server_matrix.py: "
        "paste the output of `python -m tests.server_matrix` over it")


def test_every_stack_is_launched_by_the_kernel_matrix():
    from tests.test_kernel_matrix import LAUNCHES

    assert sorted(LAUNCHES) == sorted(s.key for s in STACKS)


def test_every_other_line_names_a_test_that_exists():
    for shown in SHOWN_ELSEWHERE:
        path, name = shown.test.split("::")
        assert f"\ndef {name}(" in (REPO / path).read_text(), f"{shown.test} is not a test"

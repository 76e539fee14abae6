"""The user docs go stale loudly: the README stays short, generated pages match their sources, every
link lands, every `tokenprobe` command shown parses, and every benchmark figure names its command."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
README_LIMIT_BYTES = 10 * 1024



def load_render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", REPO / "scripts" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_generated_pages_are_current():
    stale = [path.name for path, text in load_render_docs().rendered().items() if path.read_text() != text]
    assert not stale, f"{stale} are stale: run .venv/bin/python scripts/render_docs.py"


def test_schema_page_names_every_column_of_every_table():
    from tokenprobe.contract import registry

    text = (DOCS / "schema.md").read_text()
    for table in registry.TABLES:
        section = text.split(f"\n## {table.name}\n", 1)[1].split("\n## ", 1)[0]
        listed = re.findall(r"^\| `(\w+)` \| `([^`]+)`", section, re.MULTILINE)
        assert listed == [(column.name, column.type) for column in table.columns], table.name


def test_the_row_schema_is_written_only_in_the_generated_page():
    from tokenprobe.contract.requests import REQUEST_COLUMNS

    row = re.compile(r"^\|\s*`?(" + "|".join(REQUEST_COLUMNS) + r")`?\s*\|", re.MULTILINE)
    for page in pages():
        if page.name != "schema.md":
            assert not row.search(page.read_text()), f"{page.name} lists request columns: link docs/schema.md"


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes: move detail to docs/ (limit {README_LIMIT_BYTES})"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {_slug(heading) for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def test_every_link_lands():
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            destination = (page.parent / path).resolve() if path else page
            if not destination.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def _commands(page: Path) -> list[tuple[str, list[str]]]:
    """The commands of a page's ``sh`` code blocks as (text, words): continuation lines and quotes that
    span lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", page.read_text(), re.DOTALL):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            if words:
                commands.append((pending, words))
            pending = ""
        assert not pending, f"{page.name}: unterminated command {pending!r}"
    return commands


def tokenprobe_commands() -> list[tuple[str, list[str]]]:
    return [(f"{page.name}: {text.strip()}", words[1:]) for page in pages() for text, words in _commands(page)
            if words[0] in ("tokenprobe", ".venv/bin/tokenprobe")]


def test_pages_show_tokenprobe_commands():
    shown = {words[0] for _, words in tokenprobe_commands()}
    assert {"agent", "query", "doctor", "analyze", "dashboard", "control"} <= shown


@pytest.mark.parametrize("where, argv", tokenprobe_commands(), ids=lambda value: value if isinstance(value, str) else "")
def test_every_tokenprobe_command_shown_parses(where, argv, capsys):
    from tokenprobe.cli.main import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {capsys.readouterr().err.strip()}")


def test_every_benchmark_figure_names_its_command():
    text = (DOCS / "benchmarks.md").read_text()
    sections = re.split(r"^#{2,3} ", text, flags=re.MULTILINE)[1:]
    assert sections
    for section in sections:
        title = section.splitlines()[0]
        if not re.search(r"^\|.*\d", section, re.MULTILINE):
            continue
        modules = re.findall(r"python -m benchmarks\.(\w+)", section)
        assert modules or "make bench" in section, f"benchmarks.md, {title!r}: figures without the command"
        for module in modules:
            assert (REPO / "benchmarks" / f"{module}.py").exists(), f"benchmarks.md, {title!r}: no {module}"


def module_commands() -> list[tuple[str, Path, list[str]]]:
    """Every ``python -m MODULE ...`` a page shows, as (where, the module's file, the flags given)."""
    found = []
    for page in pages():
        text = page.read_text().replace("\\\n", " ")
        for module, rest in re.findall(r"python -m ([\w.]+)([^`\n]*)", text):
            parts = module.removeprefix("tokenprobe.").split(".")
            candidates = [REPO.joinpath(*parts).with_suffix(".py"), REPO.joinpath(*parts, "__main__.py")]
            source = next((path for path in candidates if path.exists()), candidates[0])
            flags = re.findall(r"(?<!\S)(--[\w-]+)", rest.split(" #")[0])
            found.append((f"{page.name}: python -m {module}{rest}", source, flags))
    return found


def test_every_module_command_shown_exists_and_takes_its_flags():
    shown = module_commands()
    assert any("benchmarks" in where for where, _, _ in shown)
    for where, source, flags in shown:
        assert source.exists(), f"{where}: no {source.relative_to(REPO)}"
        text = source.read_text()
        unknown = [flag for flag in flags if f'"{flag}"' not in text]
        assert not unknown, f"{where}: {source.relative_to(REPO)} takes no {unknown}"


def test_every_make_target_shown_exists():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
    for page in pages():
        code = "\n".join(re.findall(r"```.*?```|`[^`\n]+`", page.read_text(), re.DOTALL))
        for target in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", code):
            assert target in targets, f"{page.name}: make {target} is no target of the Makefile"

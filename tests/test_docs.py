"""Every code block of README.md and docs/*.md runs: the documentation is a test.

Each page runs as one program: its blocks in document order, in a fresh interpreter (``-W error``), against a
fresh, empty database of its own that ``DATABASE_URL`` names and that is dropped afterwards. What each fenced
block must be:

``python``
    Executed. The blocks of a page share one namespace (like cells of a notebook), so a later block uses what
    an earlier one defined. A block whose first line starts with ``# inside an alembic revision`` runs inside
    alembic's operations context (``from alembic import op`` works there) and its ``upgrade()`` is called;
    then every table it created must be a table of the page's models (the ``MetaData`` of the page's
    declarative bases) and match it as far as alembic's ``compare_metadata`` sees (what autogenerate compares:
    columns, types, nullability, server defaults, indexes): a revision that drifts from what the mixins define
    fails there, not at the first INSERT.
``shell`` (also ``bash``, ``sh``)
    One command per line (``#`` starts a comment; ``VAR=value`` prefixes are dropped; ``a && b`` is two
    commands, each checked; other shell operators such as ``|``, ``||`` or ``;`` fail the test). ``python3``
    is read as ``python``. ``python -m venv DIR`` is checked like any ``python -m MODULE`` and makes
    ``DIR/bin/pip``, ``DIR/bin/python`` and ``DIR/bin/sa-outbox`` mean ``pip``, ``python`` and ``sa-outbox``
    on the page's later lines (the README's own install shape:
    ``python3 -m venv .venv && .venv/bin/pip install -e '.[test]'``); a ``DIR/bin/…`` of a venv the page did
    not create is not checkable and fails. Then:

    * ``sa-outbox …`` / ``python -m sa_outbox …`` — parsed by the real argument parser. ``dispatch``,
      ``worker`` and ``demo`` are only parsed; every other command runs in-process against the page's
      database and must exit 0, or the code that a comment on the line names (``# … exit 1``);
    * ``alembic …`` — runs against the page's database with this repository's ``alembic.ini``;
    * ``pip install …`` — every extra it names exists in ``pyproject.toml``;
    * ``python -m MODULE …`` (another module: the benchmark, ``venv``) — every ``--option`` of the line
      appears in the module's ``--help`` (the module itself is not run).

    Any other line fails the test.
``sql``
    Executed in one transaction that is rolled back (the block creates what it needs, e.g. roles).
``ini``
    Parsed by :mod:`configparser`.
a ``text`` block right after ``<!-- output -->``
    The standard output of the block before it, compared line by line: ``…`` inside a line stands for any text,
    a line that is only ``…`` for any number of lines.
a block right after ``<!-- illustration -->``
    A diagram or a sketch, not code; not run. ``python``, shell and ``sql`` blocks cannot be marked so.
README only: the blocks after ``<!-- demo-command -->`` and ``<!-- test-command -->``
    What ``.ci/run`` extracts and runs (checked here against the script).

Any other block fails the test: a block that cannot run is a bug in the doc. Relative links must lead to files
that exist (and ``#anchors`` to headings), except the pages other branches are adding (``PENDING_PAGES``).

Run one page by hand: ``DATABASE_URL=… python -m tests.test_docs docs/jobs.md`` (it uses that database as is).
"""

from __future__ import annotations

import configparser
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
import traceback
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import scratch_database

ROOT = Path(__file__).resolve().parent.parent
PAGES = [Path("README.md"), *sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md"))]
#: Pages other branches are writing now: links to them are allowed before they exist.
PENDING_PAGES: set[str] = set()
#: The pages issue #18 asks for (the test fails if one goes missing).
REQUIRED_PAGES = {
    "getting-started", "writing-events", "ordered-delivery", "jobs", "publishers", "consuming", "operating",
    "production", "design", "benchmarks",
}  # fmt: skip

MARKERS = ("output", "illustration", "demo-command", "test-command")
SHELL = ("shell", "bash", "sh")
RUN = ("python", *SHELL, "sql", "ini")
#: sa-outbox commands that are only parsed: they run until stopped, or build their own database.
PARSE_ONLY = {"dispatch", "worker", "demo", "dashboard"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    marker: str | None  # the <!-- marker --> right before the fence
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with the marker comment that precedes each (if any)."""
    out: list[Block] = []
    lines = (ROOT / page).read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang, start, body = line[3:].strip(), i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{page}:{start}: unclosed code block")
            before = next((lines[j].strip() for j in range(start - 2, -1, -1) if lines[j].strip()), "")
            m = re.fullmatch(r"<!--\s*([\w-]+)\s*-->", before)
            out.append(Block(page, start, lang, m.group(1) if m else None, "\n".join(body) + "\n"))
        i += 1
    return out


# --- the runner: one page, one interpreter ------------------------------------------------------------------


class DocError(AssertionError):
    pass


def _expect(block: Block, actual: str) -> None:
    """Compare the previous block's output with an ``<!-- output -->`` block (``…`` = anything)."""
    pattern = []
    for line in block.text.rstrip("\n").splitlines():
        if line.strip() == "…":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(".*".join(re.escape(part) for part in line.rstrip().split("…")) + r"[ \t]*\n")
    got = "\n".join(x.rstrip() for x in actual.rstrip("\n").splitlines()) + "\n"
    if not re.fullmatch("".join(pattern), got):
        raise DocError(f"{block.where}: the output differs.\n--- expected\n{block.text}--- got\n{actual}")


def _python(block: Block, module: types.ModuleType) -> None:
    source = "\n" * block.line + block.text  # line numbers in tracebacks are the page's own
    code = compile(source, str(block.page), "exec")
    if block.text.startswith("# inside an alembic revision"):
        from alembic.migration import MigrationContext
        from alembic.operations import Operations
        from sqlalchemy import create_engine, inspect

        engine = create_engine(os.environ["DATABASE_URL"])
        try:
            with engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
                before = set(inspect(conn).get_table_names())
                exec(code, module.__dict__)
                module.__dict__["upgrade"]()
                created = set(inspect(conn).get_table_names()) - before
                # the partitions of a partitioned table are the table's (docs/partitioning.md)
                created -= set(
                    conn.exec_driver_sql(
                        "SELECT relname FROM pg_class WHERE relispartition AND relkind = 'r'"
                    ).scalars()
                )
                _compare_with_models(block, conn, created, module)
        finally:
            engine.dispose()
        return
    exec(code, module.__dict__)


def _page_metadata(module: types.ModuleType) -> list[Any]:
    """The ``MetaData`` of the page's models: declarative bases and mapped classes it defined or imported."""
    from sqlalchemy import MetaData

    found: dict[int, MetaData] = {}
    for value in list(module.__dict__.values()):
        md = value if isinstance(value, MetaData) else getattr(value, "metadata", None)
        if isinstance(value, MetaData | type) and isinstance(md, MetaData):
            found[id(md)] = md
    return list(found.values())


def _compare_with_models(block: Block, conn: Any, created: set[str], module: types.ModuleType) -> None:
    """The tables an alembic revision block created must be what the page's models define, as far as alembic's
    ``compare_metadata`` (autogenerate's comparison, server defaults included) can tell."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    unmodelled = set(created)
    for md in _page_metadata(module):
        names = created & {t.name for t in md.tables.values() if t.schema is None}
        if not names:
            continue
        unmodelled -= names

        def ours(
            obj: Any, name: Any, type_: str, reflected: bool, compare_to: Any, names: set[str] = names
        ) -> bool:
            table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
            return table in names

        opts = {"compare_type": True, "compare_server_default": True, "include_object": ours}
        diffs = compare_metadata(MigrationContext.configure(conn, opts=opts), md)
        if diffs:
            listed = "\n".join(f"  {d!r}" for d in diffs)
            raise DocError(
                f"{block.where}: the revision does not create what the page's models define "
                f"({', '.join(sorted(names))}):\n{listed}"
            )
    if unmodelled:
        raise DocError(
            f"{block.where}: the revision creates {sorted(unmodelled)}, which no model of the page defines"
        )


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def _sa_outbox(block: Block, lineno: int, argv: list[str], comment: str) -> None:
    from sa_outbox._cli import build_parser, main

    where = f"{block.page}:{lineno}"
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        raise DocError(f"{where}: `sa-outbox {shlex.join(argv)}` does not parse") from exc
    if args.command in PARSE_ONLY:
        return
    wanted = int(m.group(1)) if (m := re.search(r"\bexit (\d+)\b", comment)) else 0
    code = main(argv)
    if code != wanted:
        raise DocError(f"{where}: `sa-outbox {shlex.join(argv)}` exited {code}, the page says {wanted}")


def _module_help(block: Block, lineno: int, module: str, argv: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    if result.returncode != 0:
        raise DocError(f"{block.page}:{lineno}: `python -m {module} --help` failed:\n{result.stderr}")
    for opt in (a.split("=")[0] for a in argv if a.startswith("--")):
        if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", result.stdout):
            raise DocError(f"{block.page}:{lineno}: python -m {module} has no option {opt}")


#: Shell syntax the docs test does not follow (``&&`` is: each command of a chain is checked).
SHELL_OPERATORS = {"|", "||", ";", "&", ">", ">>", "<", "2>", "2>&1", "&>"}
#: What ``DIR/bin/NAME`` stands for when the page created ``DIR`` with ``python -m venv DIR``.
VENV_TOOLS = {"pip": "pip", "python": "python", "python3": "python", "sa-outbox": "sa-outbox"}


def _shell(block: Block, venvs: set[str]) -> None:
    """Check each command of a shell block; ``venvs`` collects the virtual environments the page created."""
    for offset, raw in enumerate(block.text.splitlines(), start=1):
        lineno = block.line + offset
        command, _, comment = raw.partition(" #")
        if raw.lstrip().startswith("#"):
            command, comment = "", raw
        words = shlex.split(command)
        if SHELL_OPERATORS & set(words):
            raise DocError(
                f"{block.page}:{lineno}: the docs test cannot check `{command.strip()}` (shell operators)"
            )
        chain: list[list[str]] = [[]]
        for word in words:
            if word == "&&":
                chain.append([])
            else:
                chain[-1].append(word)
        if words and not all(chain):
            raise DocError(f"{block.page}:{lineno}: an empty command in `{command.strip()}`")
        for part in chain:
            _command(block, lineno, part, comment, venvs)


def _command(block: Block, lineno: int, words: list[str], comment: str, venvs: set[str]) -> None:
    shown = shlex.join(words)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    if not words:
        return
    if "/bin/" in words[0]:
        venv, _, tool = words[0].rpartition("/bin/")
        if os.path.normpath(venv) not in venvs or tool not in VENV_TOOLS:
            raise DocError(
                f"{block.page}:{lineno}: the docs test cannot check `{shown}` ({words[0]} is not pip, python "
                "or sa-outbox of a venv this page created with `python -m venv`)"
            )
        words = [VENV_TOOLS[tool], *words[1:]]
    if words[0] == "python3":
        words = ["python", *words[1:]]
    if words[0] == "sa-outbox":
        _sa_outbox(block, lineno, words[1:], comment)
    elif words[:3] == ["python", "-m", "sa_outbox"]:
        _sa_outbox(block, lineno, words[3:], comment)
    elif words[0] == "alembic":
        import alembic.config

        try:
            alembic.config.main(argv=words[1:], prog="alembic")
        except SystemExit as exc:
            if exc.code:
                raise DocError(f"{block.page}:{lineno}: `{shown}` failed") from exc
    elif words[:2] == ["pip", "install"]:
        for spec in words[2:]:
            for extras in re.findall(r"\[([^\]]*)\]", spec):
                unknown = {e.strip() for e in extras.split(",")} - _extras()
                if unknown:
                    raise DocError(f"{block.page}:{lineno}: no extra {sorted(unknown)} in pyproject.toml")
    elif words[:2] == ["python", "-m"] and len(words) > 2:
        _module_help(block, lineno, words[2], words[3:])
        if words[2] == "venv":
            dirs = [w for w in words[3:] if not w.startswith("-")]
            if not dirs:
                raise DocError(f"{block.page}:{lineno}: `{shown}` names no directory")
            venvs.update(os.path.normpath(d) for d in dirs)
    else:
        raise DocError(f"{block.page}:{lineno}: the docs test cannot check `{shown}`")


def _sql(block: Block) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(os.environ["DATABASE_URL"]).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False)) as conn:
        try:
            conn.execute(block.text.encode())
        except psycopg.Error as exc:
            raise DocError(f"{block.where}: the SQL failed: {exc}") from exc
        finally:
            conn.rollback()


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield buffer


def run_page(page: Path) -> None:
    """Run every block of ``page`` in order (see the module docs); raises :class:`DocError` on the first
    block that fails."""
    module = types.ModuleType("__main__")
    module.__dict__["__file__"] = str(ROOT / page)
    saved_main = sys.modules["__main__"]
    sys.modules["__main__"] = module
    last_output: str | None = None
    venvs: set[str] = set()  # what `python -m venv DIR` created on this page
    try:
        for block in blocks(page):
            if block.marker == "output":
                if last_output is None:
                    raise DocError(f"{block.where}: an output block must follow a python or shell block")
                _expect(block, last_output)
                last_output = None
                continue
            if block.marker in ("demo-command", "test-command"):
                if page != Path("README.md"):
                    raise DocError(f"{block.where}: only README.md carries the CI's commands")
                continue
            if block.marker == "illustration":
                if block.lang in ("python", *SHELL, "sql"):
                    raise DocError(
                        f"{block.where}: a {block.lang} block must run; it cannot be an illustration"
                    )
                continue
            with _captured() as out:
                try:
                    if block.lang == "python":
                        _python(block, module)
                    elif block.lang in SHELL:
                        _shell(block, venvs)
                    elif block.lang == "sql":
                        _sql(block)
                    elif block.lang == "ini":
                        configparser.ConfigParser().read_string(block.text)
                    else:
                        raise DocError(
                            f"{block.where}: a ```{block.lang} block is neither run nor marked: use python, shell, "
                            "sql or ini, or put <!-- output --> / <!-- illustration --> before it"
                        )
                except DocError:
                    raise
                except BaseException as exc:
                    detail = "".join(traceback.format_exception(exc))
                    raise DocError(f"{block.where}: the {block.lang} block failed:\n{detail}") from exc
                finally:
                    sys.stdout.flush()
            last_output = out.getvalue()
            sys.stdout.write(last_output)
    finally:
        sys.modules["__main__"] = saved_main
        _dispose_engines(module)


def _dispose_engines(module: types.ModuleType) -> None:
    """Close the pools of the engines a page left open (a reader's program would simply exit)."""
    import asyncio

    from sqlalchemy import Engine
    from sqlalchemy.ext.asyncio import AsyncEngine

    for value in list(module.__dict__.values()):
        if isinstance(value, Engine):
            value.dispose()
        elif isinstance(value, AsyncEngine):
            asyncio.run(value.dispose())


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture
def page_url(server_url: Any) -> Iterator[Any]:
    """A fresh, empty database for one page (dropped afterwards)."""
    with scratch_database(server_url, "sa_outbox_docs") as url:
        yield url


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_every_block_of_the_page_runs(page: Path, page_url: Any) -> None:
    env = dict(os.environ, DATABASE_URL=page_url.render_as_string(hide_password=False))
    env.pop("SA_OUTBOX_LOG_LEVEL", None)
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "tests.test_docs", str(page)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]


def test_every_page_the_issue_asks_for_exists() -> None:
    assert {p.stem for p in PAGES if p.parent == Path("docs")} >= REQUIRED_PAGES


def test_the_two_commands_are_what_ci_runs() -> None:
    """.ci/run extracts the line two lines below each marker (the fence, then the command)."""
    readme = (ROOT / "README.md").read_text().splitlines()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = {}
    for marker in ("demo-command", "test-command"):
        assert f"<!-- {marker} -->" in ci
        at = readme.index(f"<!-- {marker} -->")
        assert readme[at + 1] == "```" and readme[at + 3] == "```", marker
        commands[marker] = readme[at + 2]
    assert "pip install -q -e '.[demo]'" in commands["demo-command"]
    assert commands["demo-command"].endswith("sa-outbox demo")
    assert "pip install -q -e '.[test]'" in commands["test-command"] and "pytest" in commands["test-command"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text_ = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text_).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    inside = False
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and (m := re.match(r"#{1,6} (.*)", line)):
            found.add(_slug(m.group(1)))
    return found


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_relative_links_lead_somewhere(page: Path) -> None:
    text_ = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text_):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = ((ROOT / page).parent / path_part).resolve() if path_part else (ROOT / page)
        relative = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(resolved)
        if relative in PENDING_PAGES:
            continue
        if not resolved.exists() or (
            anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)
        ):
            broken.append(target)
    assert not broken, f"{page}: broken links {broken}"


def test_every_block_is_run_or_marked() -> None:
    """A quick check without a database: every block has a kind the runner knows."""
    for page in PAGES:
        for b in blocks(page):
            known = b.lang in RUN or b.marker in MARKERS
            assert known, f"{b.where}: a ```{b.lang} block is neither run nor marked"


if __name__ == "__main__":
    try:
        for arg in sys.argv[1:]:
            run_page(Path(arg))
    except DocError as exc:
        sys.stderr.write(f"{exc}\n")
        sys.exit(1)

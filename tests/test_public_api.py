"""The public line: one export list, checked; implementation modules private; import layering kept."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sa_outbox

PACKAGE = Path(sa_outbox.__file__).parent
PUBLIC_MODULES = {"errors", "admin", "monitoring", "doctor", "metrics", "migration", "inbox", "testing",
                  "models", "embedded", "publishers", "cdc", "web"}  # fmt: skip


def _type_checking_names() -> dict[str, str]:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{alias.name}: re-export it as itself"
                    names[alias.name] = str(imp.module)
    return names


def test_the_export_list_and_the_type_checking_block_agree() -> None:
    assert _type_checking_names() == sa_outbox._EXPORTS
    assert sorted(sa_outbox.__all__) == sorted(["__version__", *sa_outbox._EXPORTS])


def test_every_public_name_resolves_from_the_module_it_is_listed_under() -> None:
    for name, module in sa_outbox._EXPORTS.items():
        value = getattr(sa_outbox, name)
        assert value is getattr(__import__(f"sa_outbox.{module}", fromlist=[name]), name)
        owner = getattr(value, "__module__", None)
        if owner is not None and owner.startswith("sa_outbox"):
            assert owner == f"sa_outbox.{module}", f"{name} is defined in {owner}, listed under {module}"


def test_public_modules_are_the_documented_ones_and_the_rest_is_private() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    modules -= {"__init__", "__main__", "__pycache__"}
    public = {m for m in modules if not m.startswith("_")}
    assert public == PUBLIC_MODULES


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.startswith('sa_outbox')))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_the_loops_do_not_import_the_producer() -> None:
    for name in ("Dispatcher", "Worker", "AsyncDispatcher", "AsyncWorker"):
        loaded = _modules_after(f"from sa_outbox import {name}")
        assert "sa_outbox._producer" not in loaded and "sa_outbox._schema" not in loaded, (name, loaded)


def test_the_scheduler_step_does_not_import_the_producer_either() -> None:
    """The worker's maintenance step will call ``_schedules.fire_due_schedules``: importing it must keep the
    loops free of the producer and the mixins (the test above)."""
    loaded = _modules_after("import sa_outbox._schedules")
    assert "sa_outbox._producer" not in loaded and "sa_outbox._schema" not in loaded, loaded


def test_errors_is_a_leaf_module() -> None:
    assert _modules_after("import sa_outbox.errors") == {
        "sa_outbox",
        "sa_outbox._version",
        "sa_outbox.errors",
    }


def test_defining_a_model_installs_the_flush_hook() -> None:
    code = """
from sqlalchemy import event
from sqlalchemy.orm import DeclarativeBase, Session
from sa_outbox import OutboxMixin
from sa_outbox import _producer
assert not event.contains(Session, "before_flush", _producer._before_flush)
class Base(DeclarativeBase): pass
class Ev(OutboxMixin, Base): __tablename__ = "ev"
assert event.contains(Session, "before_flush", _producer._before_flush)
"""
    subprocess.run([sys.executable, "-c", code], check=True)


#: Private members of other libraries the package uses on purpose, each pinned by a test of its behaviour.
FOREIGN_PRIVATE_OK = {
    "conn._echo",  # SQLAlchemy: whether SQL logging is on for this connection (the fast path must yield to it)
    # SQLAlchemy fires connection/engine/dialect events only when one of these is set: the fast path reads
    # the same three flags to know nobody listens
    "conn._has_events",
    "conn.engine._has_events",
    "conn.dialect._has_events",
    "session._flushing",  # SQLAlchemy: an event added by a listener during a flush is written in that flush
    "session._register_persistent",  # SQLAlchemy: rows inserted by the one-statement path become persistent
    "session._remove_newly_deleted",  # SQLAlchemy: CDC rows deleted again at once become deleted objects
    "stmt._values",  # SQLAlchemy Insert: refuse .values() on an outbox INSERT the hook cannot see
    "stmt._multi_values",
    "r._mapping",  # SQLAlchemy Row: its documented mapping view
    "transport._pool",  # httpx: close the connection a trickling response holds
    # SQLAlchemy: the step its execution applies to a statement compiled with a schema_translate_map (the
    # tenant's schemas into the schema tokens), so a tenant's statement is not compiled again per tenant
    "tokened.preparer._render_schema_translates",
}


def test_no_module_reaches_into_another_objects_private_members() -> None:
    """``obj._name`` only on ``self``/``cls`` or on one of the package's own private modules (issue #18)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        for node in ast.walk(tree):
            if (
                not isinstance(node, ast.Attribute)
                or not node.attr.startswith("_")
                or node.attr.startswith("__")
            ):
                continue
            if isinstance(node.value, ast.Name) and (
                node.value.id in ("self", "cls") or node.value.id in modules
            ):
                continue
            if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super":
                continue
            found.add(ast.unparse(node))
    assert found <= FOREIGN_PRIVATE_OK, sorted(found - FOREIGN_PRIVATE_OK)

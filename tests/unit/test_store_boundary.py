"""Only the store (log/) speaks SQL to the log's tables, only the projections speak
SQL to the view tables they own, and no SQL is patched with str.replace.

The import contracts (`lint-imports`) guard the floors; these two rules live in
strings, where no import graph can see them, so they are read from the source.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The folders whose code runs in the service or ships with it; migrations are
# the schema itself and may name every table.
CODE = ["events", "log", "projections", "service", "taskledger/client", "taskledger/mcp"]
MIGRATIONS = {Path("service/ops/migrate.py")}

_LOG_TABLE = re.compile(r"\b(?:FROM|INTO|UPDATE|JOIN|TABLE)\s+(?:ONLY\s+)?(?:events|log_head)\b",
                        re.IGNORECASE)
# The views the projections own (projections/tasks.py: tasks, blockers,
# task_leases; projections/jobs.py: jobs, job_leases). The HTTP app and the
# metrics ask those modules; the writer's claim and lease queries are not held
# to this yet.
_VIEW_TABLE = re.compile(
    r"\b(?:FROM|INTO|UPDATE|JOIN|TABLE)\s+(?:ONLY\s+)?(?:tasks|blockers|task_leases|jobs|job_leases)\b", re.IGNORECASE)
VIEW_READERS = ["service/http", "service/metrics.py"]
_SQLISH = re.compile(r"\b(?:SELECT|INSERT|UPDATE|DELETE|FROM|WHERE|LIMIT|ANY|JOIN)\b|\$")


def _sources() -> list[Path]:
    out: list[Path] = []
    for top in CODE:
        out += sorted((ROOT / top).rglob("*.py"))
    return out


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string literal, f-strings by their literal parts."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines.add(first.value.lineno)
    return lines


def test_only_the_store_names_the_events_and_log_head_tables() -> None:
    paths = [p for p in _sources()
             if p.relative_to(ROOT).parts[0] != "log" and p.relative_to(ROOT) not in MIGRATIONS]
    offenders = _offenders(paths, _LOG_TABLE)
    assert offenders == [], f"SQL on the log's tables outside log/: {offenders}"


def _offenders(paths: list[Path], pattern: re.Pattern[str]) -> list[str]:
    offenders = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        offenders += [f"{path.relative_to(ROOT)}:{line}" for line, text in _strings(tree)
                      if line not in docs and pattern.search(text)]
    return offenders


def test_the_http_app_and_the_metrics_leave_the_view_tables_to_the_projections() -> None:
    paths: list[Path] = []
    for top in VIEW_READERS:
        p = ROOT / top
        paths += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    assert len(paths) > 10, paths  # the folders moved: point VIEW_READERS at them again
    offenders = _offenders(paths, _VIEW_TABLE)
    assert offenders == [], f"SQL on the view tables outside projections/ (ask projections.tasks/jobs): {offenders}"


def test_the_guard_sees_sql_on_the_view_tables() -> None:
    for text in ("SELECT created_seq FROM tasks WHERE id = $1", "SELECT 1 FROM jobs j LEFT JOIN job_leases l ON true",
                 "SELECT body FROM blockers WHERE open", "SELECT * FROM tasks t JOIN task_leases l ON true"):
        assert _VIEW_TABLE.search(text), text
    assert not _VIEW_TABLE.search("SELECT secret FROM ui_secrets")
    assert not _VIEW_TABLE.search("SELECT 1 FROM tasks_shadow")


def test_the_guard_sees_sql_on_the_log_tables() -> None:
    # the pattern above must catch the shapes the store itself writes
    for text in ("SELECT seq FROM log_head WHERE id = 1", "INSERT INTO events (seq) VALUES ($1)",
                 "UPDATE log_head SET seq = $1", "SELECT 1 FROM events e JOIN events f ON true"):
        assert _LOG_TABLE.search(text), text
    assert not _LOG_TABLE.search("SELECT seq FROM projection_checkpoints")
    assert not _LOG_TABLE.search("events in seq order")


def test_no_sql_is_patched_with_str_replace() -> None:
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and _SQLISH.search(node.args[0].value)):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], f"SQL patched with str.replace (build it from parts): {offenders}"

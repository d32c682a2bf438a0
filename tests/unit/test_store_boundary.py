"""Only the store (log/) speaks SQL to the log's tables, and no SQL is patched with str.replace.

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
    offenders = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "log" or rel in MIGRATIONS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        offenders += [f"{rel}:{line}" for line, text in _strings(tree)
                      if line not in docs and _LOG_TABLE.search(text)]
    assert offenders == [], f"SQL on the log's tables outside log/: {offenders}"


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

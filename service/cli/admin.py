"""Operator and auditor commands: rebuild, check, replay, audit export / verify / checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import asyncpg
import msgspec

from taskledger.service.cli.common import add_client_flags, add_db_flags, client, database_url
from taskledger.service.cli.common import console as _console


def _connect_url(args: argparse.Namespace) -> tuple[str, Any]:
    url, handle = database_url(args)
    return url, handle


def _wants_database(args: argparse.Namespace) -> bool:
    """replay and export read the database when told where it is, else the HTTP API when a token is set."""
    if args.database_url or args.data_dir or os.environ.get("TASKLEDGER_DATABASE_URL"):
        return True
    return not args.token


# ------------------------------------------------------------------ rebuild


def cmd_rebuild(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from taskledger.projections import catalog, framework

    try:
        chosen = catalog.select(args.projection)
    except KeyError as e:
        print(f"unknown projection {e.args[0]}; known: {', '.join(catalog.names())}", file=sys.stderr)
        return 2
    url, handle = _connect_url(args)
    console = _console(stderr=True)
    out = _console()

    async def go() -> int:
        conn = await asyncpg.connect(url)
        reader = await asyncpg.connect(url)  # reads the next page while this one folds
        try:
            with Progress(
                TextColumn("[bold]{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>12} ev/s"), TextColumn("ETA"), TimeRemainingColumn(),
                TimeElapsedColumn(), console=console, transient=False, disable=args.quiet,
            ) as bar:
                for p in chosen:
                    task = bar.add_task(p.name, total=None, rate="-")
                    t0 = time.perf_counter()

                    def progress(_: str, done: int, target: int, task: Any = task, t0: float = t0) -> None:
                        el = time.perf_counter() - t0
                        bar.update(task, completed=done, total=max(target, done),
                                   rate=f"{done / el:,.0f}" if el > 0 else "-")

                    try:
                        res = await framework.rebuild(conn, p, progress=progress, reader=reader)
                    except framework.RebuildBusy as e:
                        console.print(f"[red]{e}")
                        return 1
                    bar.update(task, completed=res.seq, total=max(res.seq, 1))
                    out.print(f"{p.name}: rebuilt to seq {res.seq} in {res.seconds:.2f}s "
                              f"({res.events_per_second:,.0f} events/s; swap held the head lock "
                              f"{res.swap_ms:.1f} ms)")
            return 0
        finally:
            await conn.close()
            await reader.close()

    rc = asyncio.run(go())
    del handle
    return rc


# ------------------------------------------------------------------ check


def cmd_check(args: argparse.Namespace) -> int:
    from taskledger.log import audit
    from taskledger.projections import catalog, framework

    try:
        chosen = catalog.select(args.projection)
    except KeyError as e:
        print(f"unknown projection {e.args[0]}; known: {', '.join(catalog.names())}", file=sys.stderr)
        return 2
    url, handle = _connect_url(args)

    async def go() -> int:
        conn = await asyncpg.connect(url)
        bad = 0
        try:
            if not args.no_chain:
                v = await audit.verify_table(conn)
                if v.ok:
                    print(f"log: hash chain ok over {v.checked} events (head {v.head_seq})")
                else:
                    bad += 1
                    print(f"log: hash chain broken at seq {v.first_bad_seq}: {v.reason}")
            diffs = await framework.check(conn, chosen)
            for d in diffs:
                print(d.describe())
            for p in chosen:
                n = sum(1 for d in diffs if d.projection == p.name)
                print(f"{p.name}: {'ok' if n == 0 else f'{n} difference(s)'}")
            bad += len(diffs)
        finally:
            await conn.close()
        return 1 if bad else 0

    rc = asyncio.run(go())
    del handle
    return rc


# ------------------------------------------------------------------ replay


def _summary(data: dict[str, Any]) -> str:
    keys = ("node", "worker", "attempt", "checker", "outcome", "category", "action", "reason", "round",
            "decision", "subtask_id", "verifier_task_ids", "checkers", "error", "title")
    parts = []
    for k in keys:
        if k in data and data[k] not in (None, "", [], {}):
            v = data[k]
            s = ",".join(map(str, v)) if isinstance(v, list) else str(v)
            parts.append(f"{k}={s[:40]}")
    return " ".join(parts[:4])


def _verdicts(s: Any) -> str:
    return " ".join(f"{v.checker}:{v.outcome}" for v in s.verdicts) or "-"


def _history_http(args: argparse.Namespace) -> list[dict[str, Any]]:
    from taskledger.client import TaskledgerError

    events: list[dict[str, Any]] = []
    with client(args) as c:
        since = 0
        while True:
            try:
                page = c.task_events(args.task, since_seq=since, limit=1000).events
            except TaskledgerError as e:
                raise SystemExit(f"GET /tasks/{args.task}/events -> {e}") from e
            events += [msgspec.to_builtins(ev) for ev in page]
            if len(page) < 1000:
                break
            since = page[-1].stream_seq
    return events


async def _history_db(url: str, task_id: str) -> list[dict[str, Any]]:
    from taskledger import log as store

    conn = await asyncpg.connect(url)
    try:
        out: list[dict[str, Any]] = []
        since = 0
        while True:
            batch = await store.read_stream(conn, f"task:{task_id}", since_stream_seq=since)
            out += [e.as_dict() for e in batch]
            if len(batch) < 1000:
                return out
            since = batch[-1].stream_seq
    finally:
        await conn.close()


def cmd_replay(args: argparse.Namespace) -> int:
    from taskledger.events.task.events import decode
    from taskledger.events.task.state import evolve

    handle = None
    if _wants_database(args):
        url, handle = _connect_url(args)
        events = asyncio.run(_history_db(url, args.task))
    else:
        events = _history_http(args)
    if args.as_of_seq is not None:
        events = [e for e in events if e["seq"] <= args.as_of_seq]
    if not events:
        print(f"task {args.task} has no events" + (f" up to seq {args.as_of_seq}" if args.as_of_seq else ""),
              file=sys.stderr)
        return 1
    rows = []
    s = None
    for e in events:
        s = evolve(s, decode(e["type"], e["data"]), seq=e["seq"], version=e["stream_seq"],
                   at=e["recorded_at"])
        rows.append((e, s))
    if args.json:
        for e, st in rows:
            print(msgspec.json.encode({
                "seq": e["seq"], "stream_seq": e["stream_seq"], "type": e["type"], "data": e["data"],
                "recorded_at": e["recorded_at"],
                "state": {"state": st.state, "attempt": st.attempt, "node": st.node, "worker": st.worker,
                          "verdicts": [f"{v.checker}:{v.outcome}" for v in st.verdicts],
                          "blocker_id": st.blocker_id, "round": st.round},
            }).decode())
    else:
        from rich.table import Table

        t = Table(title=f"task {args.task}" + (f" as of seq {args.as_of_seq}" if args.as_of_seq else ""))
        for col in ("seq", "#", "type", "data", "state", "attempt", "node", "verdicts"):
            t.add_column(col, no_wrap=col in ("seq", "#", "type", "state"))
        for e, st in rows:
            t.add_row(str(e["seq"]), str(e["stream_seq"]), e["type"], _summary(e["data"]), st.state,
                      str(st.attempt), st.node or "-", _verdicts(st))
        _console().print(t)
    del handle
    return 0


# ------------------------------------------------------------------ audit


def cmd_audit_export(args: argparse.Namespace) -> int:
    from taskledger.log import audit

    url, handle = _connect_url(args)

    async def go() -> int:
        conn = await asyncpg.connect(url)
        # a CLI with nothing else on its loop: blocking writes are fine
        f = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout  # noqa: SIM115, ASYNC230
        n = 0
        try:
            async for line in audit.export_lines(conn, args.from_seq, args.to_seq):
                f.write(line + "\n")
                n += 1
        finally:
            if f is not sys.stdout:
                f.close()
            await conn.close()
        if args.output:
            print(f"wrote {max(n - 2, 0)} events to {args.output}", file=sys.stderr)
        return 0

    rc = asyncio.run(go())
    del handle
    return rc


def cmd_audit_checkpoint(args: argparse.Namespace) -> int:
    from taskledger import log as store
    from taskledger.events import audit
    from taskledger.log import audit as stored_audit
    from taskledger.service.ops.audit_key import load_or_create
    from taskledger.service.settings import Settings

    key = load_or_create(Settings.from_env(data_dir=args.data_dir))
    url, handle = _connect_url(args)

    async def go() -> str:
        conn = await asyncpg.connect(url)
        try:
            async with conn.transaction():
                log = await store.LogTx.begin(conn)
                ev = await stored_audit.append_checkpoint(log, key)
                await log.finish()
            assert ev is not None
            text = await store.event_json_at(conn, ev.seq)
            assert text is not None
            return audit.compact(text)
        finally:
            await conn.close()

    print(asyncio.run(go()))
    del handle
    return 0


def _read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.readlines()


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from taskledger.events import audit

    key = None
    given: list[tuple[int, str, int, str]] = []
    try:
        if args.public_key is not None:
            text = args.public_key
            if os.path.isfile(text):
                text = "".join(_read_lines(text))
            key = audit.parse_public_key(text)
        if args.checkpoint:
            if key is None:
                print("--checkpoint needs --public-key: a checkpoint is only as good as its signature",
                      file=sys.stderr)
                return 2
            for path in args.checkpoint:
                given += audit.parse_checkpoints(_read_lines(path), key)
        with open(args.file, encoding="utf-8") as f:
            v = audit.verify_lines(f, public_key=key, checkpoints=given)
    except OSError as e:
        print(f"cannot read {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:
        print(f"not a UTF-8 text file (byte {e.start}): not an audit export", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"invalid input: {e}", file=sys.stderr)
        return 2
    if v.malformed:
        print(f"MALFORMED at line {v.line}: {v.reason}", file=sys.stderr)
        return 2
    if v.ok:
        signed = (f", {v.checkpoints} signed checkpoint(s)" if key is not None else
                  " (no --public-key: checkpoint signatures not checked)")
        given_note = f", through {v.external_checkpoints} given checkpoint(s)" if given else ""
        print(f"ok: {v.count} events, seq {v.first_seq}..{v.last_seq}, last hash {v.last_hash}{signed}{given_note}")
        return 0
    print(f"FAILED at line {v.line}: first bad seq {v.first_bad_seq}: {v.reason}")
    return 1


def register(sub: Any) -> None:
    p = sub.add_parser("rebuild", help="rebuild projections from the log and swap them in, without downtime")
    p.add_argument("--projection", action="append", help="a projection name (repeatable; default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_db_flags(p)
    p.set_defaults(func=cmd_rebuild)

    p = sub.add_parser("check", help="fold the log and compare every projection row; exit 1 on a difference")
    p.add_argument("--projection", action="append", help="a projection name (repeatable; default: all)")
    p.add_argument("--no-chain", action="store_true", help="skip recomputing the hash chain")
    add_db_flags(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("replay", help="a task's history, with its state after each event")
    p.add_argument("--task", required=True)
    p.add_argument("--as-of-seq", type=int, default=None)
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    add_client_flags(p)
    add_db_flags(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("audit", help="export the log with its hash chain, or verify an export")
    asub = p.add_subparsers(dest="audit_command", required=True)
    e = asub.add_parser("export", help="write the log as JSON lines (docs/AUDIT.md)")
    e.add_argument("--from-seq", type=int, default=1)
    e.add_argument("--to-seq", type=int, default=None)
    e.add_argument("--output", "-o", default=None, help="file (default: stdout)")
    add_db_flags(e)
    e.set_defaults(func=cmd_audit_export)
    v = asub.add_parser("verify", help="recompute an export's hash chain and check its signed checkpoints; "
                                       "exit 1 naming the first bad event, 2 when the input is malformed")
    v.add_argument("file")
    v.add_argument("--public-key", default=None,
                   help="the key GET /audit/key publishes (base64), or a file holding it")
    v.add_argument("--checkpoint", action="append", default=[],
                   help="a file of checkpoints kept outside the database (repeatable)")
    v.set_defaults(func=cmd_audit_verify)
    c = asub.add_parser("checkpoint", help="append a signed checkpoint over the head now; print it as one "
                                           "JSON line, to keep outside the database")
    add_db_flags(c)
    c.set_defaults(func=cmd_audit_checkpoint)


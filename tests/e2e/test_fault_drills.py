"""Fault drills under a writer load with idempotency keys and an SSE follower:
every acknowledged write is in the log once, retries never double an event, the
follower's ids are contiguous, and writes are refused only with 503 (or a lost
connection) while the fault lasts. Figures: bench/fault_drills.py, docs/BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.drills import DRILLS, run_drill


@pytest.mark.slow
@pytest.mark.parametrize("drill", DRILLS)
def test_a_fault_loses_no_acknowledged_write_doubles_no_retry_and_skips_no_event(
    drill: str, tmp_path: Path
) -> None:
    res = run_drill(drill, tmp_path)
    assert res.acked >= 20, res
    assert res.missing == [], f"acknowledged but not in the log: {res.missing[:5]}"
    assert res.duplicated == [], f"retries made two events: {res.duplicated[:5]}"
    assert res.chain_ok
    assert res.follower_contiguous(), (res.head, res.follower_ids[:5], res.follower_ids[-5:])
    assert res.recovery_seconds < 30, res  # it comes back by itself
    assert set(res.refused) <= {0, 503}, res.refused  # never a 500
    # the drill leaves no PostgreSQL behind, whichever way it hurt it
    assert not (tmp_path / "pg" / "pgdata" / "postmaster.pid").exists()

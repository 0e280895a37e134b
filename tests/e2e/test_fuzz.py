"""bench/fuzz.py in CI: a real worker process under 20 s of hostile sessions (stalling inputs
included), with an honest client checking its values; the script's own checks decide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .e2e_harness import subprocess_env

FUZZ = Path(__file__).resolve().parents[2] / "bench" / "fuzz.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twenty_seconds_of_hostile_sessions_leave_the_worker_serving_and_holding_nothing() -> None:
    argv = [sys.executable, str(FUZZ), "--seconds", "20", "--sessions", "3", "--alone", "2", "--stall"]
    done = subprocess.run(
        [*argv, "--check-rss"], check=False, capture_output=True, text=True, timeout=280, env=subprocess_env()
    )
    report = done.stdout + done.stderr[-4000:]
    # The script exits 1 on a worker crash, a batch neither answered nor ended with an error, a
    # wrong value read, a session left open, or in-use memory, the bytes charged to sessions or
    # the worker's RSS not back to their baseline (taken after a warm-up of every hostile kind).
    assert done.returncode == 0, report
    assert "| honest wrong values / errors | 0 / 0 |" in done.stdout, report
    assert "| worker alive at the end | yes |" in done.stdout, report
    assert "| sessions open at the end (besides the probe) | 0 |" in done.stdout, report
    assert "(BUG)" not in done.stdout, report

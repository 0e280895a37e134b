"""The examples a newcomer runs, run as scripts: on this machine's CPU and through a worker process."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .e2e_harness import Keys, WorkerProcess, subprocess_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# A short run of the small configuration: enough steps to fall well below the baseline.
TINY = ["--batch", "16", "--context", "32", "--sample", "40"]


def run_example(name: str, *args: str, key: Path | None = None) -> str:
    env = subprocess_env()
    if key is not None:
        env["EMBERLINK_KEY"] = str(key)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def step_losses(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^step +(\d+) +loss ([\d.]+)", out, re.MULTILINE)}


@pytest.fixture(autouse=True)
def one_blas_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenBLAS threads spin-wait; on a machine busier than its cores, a run with them slows down
    # a hundredfold. One thread keeps these runs' length independent of the machine's load.
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")


def test_tiny_transformer_loss_falls_below_the_unigram_baseline() -> None:
    out = run_example("tiny_transformer.py", *TINY, "--steps", "100", "--log-every", "20")
    baseline = float(re.search(r"unigram baseline .*: ([\d.]+) nats/char", out)[1])  # type: ignore[index]
    held_out = float(re.search(r"held-out loss ([\d.]+)", out)[1])  # type: ignore[index]
    losses = step_losses(out)
    assert sorted(losses) == [20, 40, 60, 80, 100]
    assert float(losses[100]) < 0.9 * baseline and held_out < 0.9 * baseline, out
    sample = out.split("sample (after a held-out prompt):\n", 1)[1]
    assert len(sample) >= 40, out


def test_tiny_transformer_through_a_worker_matches_the_cpu_run_step_for_step(
    start_worker: Callable[..., WorkerProcess], keys: Keys
) -> None:
    args = (*TINY, "--steps", "20", "--log-every", "5")
    local = run_example("tiny_transformer.py", *args)
    worker = start_worker()
    remote = run_example("tiny_transformer.py", *args, "--device", worker.ticket, key=keys.client_key)
    assert f"training on remote({worker.ticket})" in remote
    assert step_losses(remote) == step_losses(local) and len(step_losses(local)) == 4

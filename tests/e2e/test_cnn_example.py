"""examples/cnn_digits.py as a newcomer runs it: on this machine's CPU, and through an `emberlink
worker` process by its ticket."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .e2e_harness import Keys, subprocess_env

EXAMPLE = Path(__file__).parents[2] / "examples" / "cnn_digits.py"


def run_example(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def final_accuracy(stdout: str) -> float:
    match = re.search(r"^final test accuracy (\d\.\d+)$", stdout, re.MULTILINE)
    assert match, stdout
    return float(match.group(1))


def test_the_cnn_example_reaches_95_percent_test_accuracy_on_cpu_in_two_epochs() -> None:
    stdout = run_example("--epochs", "2")
    assert final_accuracy(stdout) >= 0.95, stdout
    # one graph per kind of step: train step 1 (Adam's state is new), steps 2.., the test pass
    built = int(re.search(r"graphs built (\d+)", stdout).group(1))  # type: ignore[union-attr]
    assert built <= 4, stdout


def test_the_cnn_example_trains_the_same_through_a_worker(start_worker, keys: Keys) -> None:
    worker = start_worker()
    env = subprocess_env() | {"EMBERLINK_KEY": str(keys.client_key)}
    remote = run_example("--device", worker.ticket, "--epochs", "1", env=env)
    local = run_example("--epochs", "1")
    assert f"training on remote({worker.ticket})" in remote
    epoch = [line for line in local.splitlines() if line.startswith("epoch")]
    assert epoch and epoch == [line for line in remote.splitlines() if line.startswith("epoch")]

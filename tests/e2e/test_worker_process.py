"""End to end with real processes: `emberlink worker` started by the CLI, clients in this process
and in others. Waits are bounded only to detect hangs; nothing here asserts a speed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import emberlink as el
from emberlink.client.remote import RemoteExecutor
from emberlink.errors import AuthError, GoingAway, WorkerLost
from emberlink.protocol.ticket import Ticket

from .e2e_harness import Keys, WorkerProcess, subprocess_env

HANG = 5.0  # seconds: a call still blocked after this is a hang, not slowness


def remote(ticket: str, key: Path) -> el.Device:
    return el.Device.remote(ticket, key=str(key), timeout=10)


def worker_stats(dev: el.Device) -> dict[str, int | float | str]:
    executor = dev._executor
    assert isinstance(executor, RemoteExecutor)
    return executor.worker_stats()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_worker_prints_its_ticket_first_and_writes_the_ticket_file(
    start_worker, keys: Keys, tmp_path: Path
) -> None:
    ticket_file = tmp_path / "ticket"
    worker = start_worker("--ticket-file", str(ticket_file))
    ticket = Ticket.parse(worker.ticket)
    assert ticket.node_id == keys.worker.node_id
    assert ticket.addrs[0][0] == "127.0.0.1" and ticket.addrs[0][1] != 0
    assert ticket_file.read_text().strip() == worker.ticket


def test_a_client_script_in_another_process_uses_the_worker(start_worker, keys: Keys) -> None:
    worker = start_worker()
    script = textwrap.dedent(
        f"""
        import numpy as np, emberlink as el
        with el.Device.remote({worker.ticket!r}) as dev:
            x = dev.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
            print(float((x @ x.T).sum()), dev.stats()["path"])
        """
    )
    env = subprocess_env() | {"EMBERLINK_KEY": str(keys.client_key)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert out.stdout.split() == [str(float((x @ x.T).sum())), "tcp"]  # the worker serves tcp by default
    assert keys.client.node_id in worker.stderr()  # the session was logged with the client's NodeId


def test_a_script_that_exits_with_its_device_open_ends_its_session_at_once(start_worker, keys: Keys) -> None:
    # Without the exit hook the session's link just drops, and the worker keeps the session (and
    # its memory) detached for the whole resume window, waiting for a resume that cannot come.
    worker = start_worker("--resume-window", "60")
    script = textwrap.dedent(
        f"""
        import numpy as np, emberlink as el
        dev = el.Device.remote({worker.ticket!r})
        x = dev.tensor(np.ones(1 << 16, dtype=np.float32))
        print(float(x.sum()))
        """
    )
    env = subprocess_env() | {"EMBERLINK_KEY": str(keys.client_key)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(float(1 << 16))]
    deadline = time.monotonic() + 10
    while "ended (" not in worker.stderr() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = worker.stderr()
    assert "ended (" in log, log  # the session ended well inside the 60 s window
    assert "to resume" not in log, log  # and was never kept detached


def test_a_client_key_not_on_the_allow_list_is_refused_naming_its_node_id(start_worker, keys: Keys) -> None:
    worker = start_worker()
    stranger, key = keys.stranger_key()
    with pytest.raises(AuthError, match=stranger.node_id):
        remote(worker.ticket, key)
    assert wait_until(lambda: stranger.node_id in worker.stderr())  # the worker logs whom it refused


def test_killed_worker_fails_waiting_and_later_calls_with_worker_lost_after_the_resume_window(
    start_worker, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBERLINK_RESUME_WINDOW", "1")  # the client tries to resume for 1 s, in vain
    worker = start_worker()
    dev = remote(worker.ticket, keys.client_key)
    steps = 0
    raised: list[tuple[BaseException, float]] = []

    def train() -> None:
        nonlocal steps
        w = dev.tensor(np.ones((256, 256), np.float32))
        x = dev.tensor(np.ones((256, 256), np.float32))
        try:
            while True:
                w = (w @ x) * 0.001
                float(w.sum())
                steps += 1
        except Exception as e:  # noqa: BLE001 - inspected below
            raised.append((e, time.monotonic()))

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    assert wait_until(lambda: steps >= 5)
    killed_at = time.monotonic()
    worker.signal(signal.SIGKILL)
    thread.join(HANG)
    assert raised, "the waiting call did not return after the worker died"
    error, at = raised[0]
    assert isinstance(error, WorkerLost)
    assert at - killed_at < HANG
    with pytest.raises(WorkerLost):
        dev.sync()
    with pytest.raises(WorkerLost):
        dev.tensor(np.zeros(3)).numpy()
    dev.close()


def test_frozen_worker_fails_waiting_calls_with_worker_lost_after_the_resume_window(
    start_worker, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBERLINK_RESUME_WINDOW", "1")
    worker = start_worker()
    dev = remote(worker.ticket, keys.client_key)
    x = dev.tensor(np.ones(8, np.float32))
    assert float(x.sum()) == 8.0
    worker.signal(signal.SIGSTOP)  # alive but silent: no FIN, no RST; only keepalive can tell
    try:
        started = time.monotonic()
        with pytest.raises(WorkerLost):
            float((x * 2.0).sum())
        assert time.monotonic() - started < HANG
    finally:
        worker.kill()
    dev.close()


CLIENT_UPLOADING = """
import sys, numpy as np, emberlink as el
dev = el.Device.remote(sys.argv[1], timeout=10)
big = np.ones(64 << 20, np.float32)  # 256 MiB
print("uploading", flush=True)
while True:  # upload after upload until killed: one that finished cannot close the window
    dev.tensor(big).sum().numpy()
"""


def test_client_killed_mid_upload_frees_its_memory_and_others_are_served(start_worker, keys: Keys) -> None:
    # Its session is detached, still charged, for the resume window, then ends and frees everything.
    worker = start_worker("--resume-window", "1")
    observer = remote(worker.ticket, keys.client_key)
    baseline = observer.memory_stats()["in_use_bytes"]
    env = subprocess_env() | {"EMBERLINK_KEY": str(keys.client_key)}
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT_UPLOADING, worker.ticket], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "uploading"
        # Mid-upload: the worker has reserved the upload's bytes but not yet received them all.
        assert wait_until(lambda: observer.memory_stats()["in_use_bytes"] >= baseline + (256 << 20), 30)
        client.send_signal(signal.SIGKILL)
        client.wait(10)
    finally:
        client.kill()
        client.wait()
        if client.stdout is not None:
            client.stdout.close()
    assert wait_until(lambda: observer.memory_stats()["in_use_bytes"] == baseline, 10)
    assert worker_stats(observer)["sessions_open"] == 1
    x = observer.tensor(np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal((x * 2.0).numpy(), np.arange(5, dtype=np.float32) * 2)
    observer.close()


def test_sigterm_ends_sessions_going_away_and_exits_cleanly(start_worker, keys: Keys) -> None:
    worker = start_worker()
    dev = remote(worker.ticket, keys.client_key)
    x = dev.tensor(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal((x + 1.0).numpy(), np.arange(4, dtype=np.float32) + 1)
    worker.signal(signal.SIGTERM)
    assert worker.wait(HANG * 2) == 0
    with pytest.raises(GoingAway):
        dev.sync()
    assert "draining" in worker.stderr()
    dev.close()


def test_ping_reports_handshake_and_round_trip_times(start_worker, keys: Keys) -> None:
    worker = start_worker()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "emberlink",
            "ping",
            worker.ticket,
            "--key",
            str(keys.client_key),
            "--count",
            "5",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "handshake:" in out.stdout and "round trip: median" in out.stdout


def _worker_exit(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_start_up_errors_are_reported_clearly_with_exit_status_2(keys: Keys, tmp_path: Path) -> None:
    missing = _worker_exit(["--key", str(tmp_path / "nope.key"), "--allow-any"])
    assert missing.returncode == 2 and "nope.key" in missing.stderr and missing.stdout == ""
    bad_allow = tmp_path / "bad-allow"
    bad_allow.write_text(f"{keys.client.node_id}\nnot-a-node-id\n")
    malformed = _worker_exit(["--key", str(keys.worker_key), "--allow", str(bad_allow)])
    assert malformed.returncode == 2 and f"{bad_allow}:2" in malformed.stderr
    os.chmod(keys.worker_key, 0o644)
    readable = _worker_exit(["--key", str(keys.worker_key), "--allow-any"])
    assert readable.returncode == 2 and "chmod 600" in readable.stderr


def test_allow_any_is_logged_loudly(keys: Keys, tmp_path: Path) -> None:
    worker = WorkerProcess(
        ["--listen", "127.0.0.1:0", "--key", str(keys.worker_key), "--allow-any"],
        subprocess_env(),
        tmp_path / "any.log",
    )
    try:
        assert wait_until(lambda: "ANY client" in worker.stderr())
    finally:
        worker.close()


def test_demo_trains_through_an_in_process_worker() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "emberlink", "demo"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    accuracy = next(line for line in out.stdout.splitlines() if line.startswith("test accuracy:"))
    assert float(accuracy.split(":")[1]) > 0.9
    assert "median step time:" in out.stdout and "bytes sent per step:" in out.stdout

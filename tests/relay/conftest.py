"""Every relay test starts from a client with no trust and no relay credentials configured, whatever
the machine's ~/.config/emberlink holds; a test adds what it needs (relay_harness.trust_workers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from emberlink.client.trust import CLUSTER_ENV, KNOWN_WORKERS_ENV
from emberlink.transport.nats_access import CA_ENV, CREDS_ENV


@pytest.fixture(autouse=True)
def client_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    known = tmp_path / "known_workers"
    monkeypatch.setenv(KNOWN_WORKERS_ENV, str(known))
    for name in (CLUSTER_ENV, CREDS_ENV, CA_ENV):
        monkeypatch.delenv(name, raising=False)
    yield known

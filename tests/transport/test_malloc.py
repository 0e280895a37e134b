"""glibc malloc tuning: applied on glibc, repeatable, and a client can opt out."""

from __future__ import annotations

import platform

import pytest

from emberlink.transport import malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="mallopt tuning applies to glibc only")
def test_tuning_applies_on_glibc_and_can_be_repeated() -> None:
    assert malloc.tune_malloc() is True
    assert malloc.tune_malloc() is True


def _record(calls: list[int]) -> bool:
    """A tune_malloc stand-in: counts the call, reports success."""
    calls.append(1)
    return True


@pytest.mark.parametrize("value", ["0", "off", "false", "no"])
def test_client_tuning_is_skipped_when_the_environment_says_so(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(malloc, "tune_malloc", lambda: _record(calls))
    monkeypatch.setenv("EMBERLINK_TUNE_MALLOC", value)
    assert malloc.tune_malloc_unless_disabled() is False
    assert calls == []


def test_client_tuning_is_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(malloc, "tune_malloc", lambda: _record(calls))
    monkeypatch.delenv("EMBERLINK_TUNE_MALLOC", raising=False)
    assert malloc.tune_malloc_unless_disabled() is True
    assert calls == [1]

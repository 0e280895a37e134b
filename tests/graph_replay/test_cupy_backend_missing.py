"""Constructing the CuPy backend where CuPy is missing says what to install (runs everywhere)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from emberlink.errors import DeviceError
from emberlink.graph_replay.cupy_backend import CupyBackend


def test_without_cupy_the_backend_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(DeviceError, match=r"CuPy is not installed.*emberlink\[cuda13\].*emberlink\[cuda12\]"):
        CupyBackend()


def test_importing_the_module_does_not_import_cupy() -> None:
    code = "import sys, emberlink.graph_replay.cupy_backend; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

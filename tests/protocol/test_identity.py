"""Identities, NodeIds, key files, allow policies and `emberlink keygen`."""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest

from emberlink.cli import main
from emberlink.errors import ConfigError, ProtocolError
from emberlink.protocol.identity import (
    AllowPolicy,
    Identity,
    Rng,
    load_or_create,
    node_id_from_public,
    public_from_node_id,
    verify,
)


def rng(seed: int = 1) -> Rng:
    return random.Random(seed).randbytes


def test_node_id_is_lowercase_unpadded_base32_of_the_public_key() -> None:
    ident = Identity.generate(rng())
    assert len(ident.node_id) == 52
    assert ident.node_id == ident.node_id.lower()
    assert "=" not in ident.node_id
    assert public_from_node_id(ident.node_id) == ident.public_bytes
    assert node_id_from_public(ident.public_bytes) == ident.node_id


def test_node_id_of_known_key() -> None:
    ident = Identity.from_seed(bytes(32))
    assert ident.public_bytes.hex() == "3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29"
    assert ident.node_id == "hnvcppgow2sc2yvdvdicu3ynonsteflxdxrehjr2ybekdc2z3iuq"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "hnvcppgow2sc2yvdvdicu3ynonsteflxdxrehjr2ybekdc2z3iu",  # one short
        "hnvcppgow2sc2yvdvdicu3ynonsteflxdxrehjr2ybekdc2z3iuqa",  # one long
        "HNVCPPGOW2SC2YVDVDICU3YNONSTEFLXDXREHJR2YBEKDC2Z3IUQ",  # uppercase
        "hnvcppgow2sc2yvdvdicu3ynonsteflxdxrehjr2ybekdc2z3iu1",  # 1 is not base32
        "hnvcppgow2sc2yvdvdicu3ynonsteflxdxrehjr2ybekdc2z3iur",  # non-zero padding bits
        "hnvcppgow2sc2yvdvdicu3ynonsteflxdxrehjr2ybekdc2z3iu=",
    ],
)
def test_malformed_node_id_is_refused(bad: str) -> None:
    with pytest.raises(ProtocolError):
        public_from_node_id(bad)


def test_public_key_of_wrong_length_is_refused() -> None:
    with pytest.raises(ProtocolError):
        node_id_from_public(bytes(31))


def test_signature_verifies_with_the_public_key_only() -> None:
    ident = Identity.generate(rng())
    sig = ident.sign(b"data")
    assert verify(ident.public_bytes, sig, b"data")
    assert not verify(ident.public_bytes, sig, b"other")
    assert not verify(Identity.generate(rng(2)).public_bytes, sig, b"data")


def test_saved_key_file_is_mode_0600_and_loads_back(tmp_path: Path) -> None:
    ident = Identity.generate(rng())
    path = tmp_path / "k.key"
    ident.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).node_id == ident.node_id
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_save_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    Identity.generate(rng(1)).save(path)
    other = Identity.generate(rng(2))
    with pytest.raises(ConfigError, match="already exists"):
        other.save(path)
    other.save(path, overwrite=True)
    assert Identity.load(path).node_id == other.node_id


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_key_file_readable_by_others_is_refused_with_the_chmod_to_run(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "k.key"
    Identity.generate(rng()).save(path)
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match=f"chmod 600 {path}"):
        Identity.load(path)


def test_malformed_or_missing_key_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    with pytest.raises(ConfigError):
        Identity.load(path)
    path.write_bytes(b"not a key")
    path.chmod(0o600)
    with pytest.raises(ConfigError):
        Identity.load(path)


def test_load_or_create_creates_once_with_private_parent_dirs(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "client.key"
    first, created = load_or_create(path, rng())
    assert created
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second, created_again = load_or_create(path, rng(2))
    assert not created_again
    assert second.node_id == first.node_id


def test_allow_file_ignores_blank_lines_and_comments(tmp_path: Path) -> None:
    a, b, c = (Identity.generate(rng(i)).node_id for i in range(3))
    path = tmp_path / "allow"
    path.write_text(f"# team\n\n{a}\n  {b}  # laptop\n")
    policy = AllowPolicy.from_file(path)
    assert policy.admits(a) and policy.admits(b)
    assert not policy.admits(c)
    assert not policy.admits_anyone


def test_malformed_allow_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "allow"
    path.write_text(f"{Identity.generate(rng()).node_id}\n\nnot-a-node-id\n")
    with pytest.raises(ConfigError, match=f"{path}:3"):
        AllowPolicy.from_file(path)


def test_allow_any_and_allow_of() -> None:
    a, b = (Identity.generate(rng(i)).node_id for i in range(2))
    assert AllowPolicy.allow_any().admits(a)
    assert AllowPolicy.allow_any().admits_anyone
    assert AllowPolicy.of([a]).admits(a)
    assert not AllowPolicy.of([a]).admits(b)
    with pytest.raises(ConfigError):
        AllowPolicy.of(["nope"])


def test_keygen_writes_a_0600_key_and_prints_its_node_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dir" / "w.key"
    assert main(["keygen", "--out", str(path)]) == 0
    node_id = capsys.readouterr().out.strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).node_id == node_id


def test_keygen_refuses_to_overwrite_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.key"
    assert main(["keygen", "--out", str(path)]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["keygen", "--out", str(path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert Identity.load(path).node_id == first
    assert main(["keygen", "--out", str(path), "--force"]) == 0
    assert Identity.load(path).node_id == capsys.readouterr().out.strip() != first


def test_keygen_default_path_is_emberlink_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "env.key"
    monkeypatch.setenv("EMBERLINK_KEY", str(path))
    assert main(["keygen"]) == 0
    assert Identity.load(path).node_id == capsys.readouterr().out.strip()


def test_keygen_default_path_without_env_is_under_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("EMBERLINK_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["keygen"]) == 0
    path = tmp_path / ".config" / "emberlink" / "client.key"
    assert Identity.load(path).node_id == capsys.readouterr().out.strip()


def test_id_prints_the_node_id_of_an_existing_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "env.key"
    monkeypatch.setenv("EMBERLINK_KEY", str(path))
    assert main(["keygen"]) == 0
    node_id = capsys.readouterr().out.strip()
    assert main(["id"]) == 0
    assert capsys.readouterr().out.strip() == node_id
    assert main(["id", "--key", str(tmp_path / "missing.key")]) == 1
    assert "emberlink keygen --out" in capsys.readouterr().err

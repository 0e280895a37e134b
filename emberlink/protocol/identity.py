"""Node identities (Ed25519 key files, NodeIds) and allow policies; no network I/O, no global randomness.

Rules:
- A NodeId is the 32-byte Ed25519 public key in lowercase base32 without padding (52 characters).
  Only the canonical spelling is accepted, so one key has exactly one NodeId.
- Key files are written with mode 0600 (parent directories 0700) and are refused, with the chmod to
  run, when group or others can read them.
- Randomness is a parameter (`Rng`); production code passes `os.urandom`.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from emberlink.errors import ConfigError, ProtocolError

Rng = Callable[[int], bytes]
"""Randomness source: `rng(n)` returns n fresh random bytes (production: `os.urandom`)."""

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
NODE_ID_LENGTH = 52
_BASE32_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")


def draw(rng: Rng, n: int) -> bytes:
    """Take exactly n bytes from rng; a source that returns another length is a bug."""
    data = rng(n)
    if not isinstance(data, bytes) or len(data) != n:
        raise ValueError(f"rng returned {len(data) if isinstance(data, bytes) else type(data)!r}, wanted {n}")
    return data


def node_id_from_public(public: bytes) -> str:
    """The NodeId of a 32-byte Ed25519 public key."""
    if len(public) != PUBLIC_KEY_SIZE:
        raise ProtocolError(f"an Ed25519 public key is {PUBLIC_KEY_SIZE} bytes, got {len(public)}")
    return base64.b32encode(bytes(public)).decode("ascii").rstrip("=").lower()


def public_from_node_id(node_id: str) -> bytes:
    """The 32-byte public key a NodeId names; ProtocolError unless node_id is a canonical NodeId."""
    if not isinstance(node_id, str):
        raise ProtocolError(f"a NodeId is a string, got {type(node_id).__name__}")
    if len(node_id) != NODE_ID_LENGTH:
        raise ProtocolError(
            f"a NodeId is {NODE_ID_LENGTH} base32 characters (a 32-byte key), got {len(node_id)}: {node_id!r:.80}"
        )
    if not set(node_id) <= _BASE32_ALPHABET:
        raise ProtocolError(f"a NodeId is lowercase base32 (a-z, 2-7), got {node_id!r}")
    try:
        public = base64.b32decode(node_id.upper() + "====")
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"bad base32 in NodeId {node_id!r}") from e
    # The last character carries 4 unused bits; only the spelling with zeros there is canonical.
    if node_id_from_public(public) != node_id:
        raise ProtocolError(f"NodeId {node_id!r} is not canonical base32")
    return public


class Identity:
    """An Ed25519 key pair: who this node is."""

    __slots__ = ("_private", "node_id", "public_bytes")

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_bytes: bytes = private.public_key().public_bytes_raw()
        self.node_id: str = node_id_from_public(self.public_bytes)

    @classmethod
    def generate(cls, rng: Rng) -> Identity:
        """A new identity from 32 bytes of rng."""
        return cls(Ed25519PrivateKey.from_private_bytes(draw(rng, 32)))

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity whose 32-byte Ed25519 private seed is `seed` (tests and vectors)."""
        if len(seed) != 32:
            raise ValueError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read a key file; ConfigError if it is missing, malformed, or readable by group or others."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ConfigError(f"cannot read key file {path}: {e.strerror}") from e
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError(
                    f"key file {path} is accessible by group or others (mode {stat.S_IMODE(mode):04o}); "
                    f"run: chmod 600 {path}"
                )
            data = f.read(64 * 1024)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"key file {path} does not hold a PEM Ed25519 private key") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the key (PEM PKCS#8) with mode 0600; ConfigError if it exists and not overwrite."""
        path = Path(path)
        pem = self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        # Write a fresh 0600 file beside the target and rename it, so no reader ever sees a
        # half-written key or a moment with looser permissions.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, pem)
                os.fsync(fd)
            finally:
                os.close(fd)
            if overwrite:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails if path exists, atomically
        except FileExistsError as e:
            raise ConfigError(f"key file {path} already exists") from e
        except OSError as e:
            raise ConfigError(f"cannot write key file {path}: {e.strerror}") from e
        finally:
            tmp.unlink(missing_ok=True)

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of data."""
        return self._private.sign(data)

    def __repr__(self) -> str:
        return f"Identity({self.node_id})"


def verify(public: bytes, signature: bytes, data: bytes) -> bool:
    """Whether signature is public's Ed25519 signature of data."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def read_config_text(path: Path, what: str) -> str:
    """The UTF-8 text of the `what` file at `path` (an allow list, a certificate); ConfigError naming
    it if it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e


def default_key_path(env: Mapping[str, str] = os.environ) -> Path:
    """$EMBERLINK_KEY, else ~/.config/emberlink/client.key."""
    configured = env.get("EMBERLINK_KEY")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".config" / "emberlink" / "client.key"


def load_or_create(path: str | os.PathLike[str], rng: Rng = os.urandom) -> tuple[Identity, bool]:
    """Load the key at path, or create it (parent directories 0700); returns (identity, created)."""
    path = Path(path)
    if path.exists():
        return Identity.load(path), False
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create directory {path.parent}: {e.strerror}") from e
    identity = Identity.generate(rng)
    try:
        identity.save(path)
    except ConfigError:
        if path.exists():  # another process created it first: use theirs
            return Identity.load(path), False
        raise
    return identity, True


@dataclass(frozen=True, slots=True)
class AllowPolicy:
    """Which client NodeIds a worker admits: a fixed set, or anyone (`allow_any`, to be logged)."""

    node_ids: frozenset[str] | None

    @classmethod
    def allow_any(cls) -> AllowPolicy:
        return cls(None)

    @classmethod
    def of(cls, node_ids: Iterable[str]) -> AllowPolicy:
        """Admit exactly these NodeIds; ConfigError on a malformed one."""
        ids = frozenset(node_ids)
        for node_id in ids:
            try:
                public_from_node_id(node_id)
            except ProtocolError as e:
                raise ConfigError(f"allow list: {e}") from e
        return cls(ids)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AllowPolicy:
        """One NodeId a line; blank lines and `#` comments ignored; ConfigError names file and line."""
        path = Path(path)
        text = read_config_text(path, "allow file")
        ids: set[str] = set()
        for lineno, line in enumerate(text.splitlines(), start=1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            try:
                public_from_node_id(entry)
            except ProtocolError as e:
                raise ConfigError(f"{path}:{lineno}: not a NodeId: {e}") from e
            ids.add(entry)
        return cls(frozenset(ids))

    @property
    def admits_anyone(self) -> bool:
        return self.node_ids is None

    def admits(self, node_id: str) -> bool:
        return self.node_ids is None or node_id in self.node_ids

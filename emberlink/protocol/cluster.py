"""Cluster certificates: a cluster key's signature on one worker's key; encoding and checking, no network
I/O, no clocks (the time is a parameter).

Rules (everything that decides whether a certificate vouches for a worker lives here):
- A cluster key is an Ed25519 key like any node's, in the same key file format. Its ClusterId is
  its public key spelled as a NodeId (52 lowercase base32 characters).
- A certificate is the msgpack array `[1, body, signature]`; `body` is the msgpack array
  `[cluster public key (32 bytes), worker public key (32 bytes), not_after]` and `signature` is
  the cluster key's Ed25519 signature over `LABEL ‖ body`. `not_after` is the last second (Unix
  time) it is good for; 0 means it does not expire.
- Decoding is strict (exact types and lengths) and checks the signature against the cluster key the
  body names, so a certificate that decodes was made by that cluster key; whether that cluster is
  trusted, and whether the certificate is still in date, is the reader's question (`vouches_for`).
- A certificate file holds one line, `emberlink-cert:` and the certificate in unpadded base64url;
  blank lines and `#` comments around it are ignored.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import msgpack

from emberlink.errors import AuthError, ConfigError, ProtocolError
from emberlink.protocol.identity import (
    PUBLIC_KEY_SIZE,
    Identity,
    node_id_from_public,
    public_from_node_id,
    verify,
)

VERSION = 1
LABEL = b"emberlink cluster certificate v1\x00"
TEXT_PREFIX = "emberlink-cert:"
MAX_CERTIFICATE = 256
"""An encoded certificate is at most this many bytes."""
_MAX_TIME = 1 << 62


@dataclass(frozen=True, slots=True)
class Certificate:
    """Cluster `cluster_id` vouches for worker `worker_id` until `not_after` (0: no end)."""

    cluster_id: str
    worker_id: str
    not_after: int
    signature: bytes

    @property
    def body(self) -> bytes:
        data: bytes = msgpack.packb(
            [public_from_node_id(self.cluster_id), public_from_node_id(self.worker_id), self.not_after],
            use_bin_type=True,
        )
        return data

    def encode(self) -> bytes:
        data: bytes = msgpack.packb([VERSION, self.body, self.signature], use_bin_type=True)
        return data

    def text(self) -> str:
        """The certificate file's line."""
        return TEXT_PREFIX + base64.urlsafe_b64encode(self.encode()).decode("ascii").rstrip("=")

    def vouches_for(self, worker_id: str, clusters: Collection[str], now: float) -> bool:
        """Whether this certificate makes `worker_id` trusted for a reader trusting `clusters` at `now`."""
        in_date = self.not_after == 0 or now <= self.not_after
        return self.worker_id == worker_id and self.cluster_id in clusters and in_date

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the certificate file (it holds no secret: mode 0644)."""
        path = Path(path)
        try:
            with path.open("w" if overwrite else "x", encoding="ascii") as f:
                f.write(f"# emberlink worker {self.worker_id}, cluster {self.cluster_id}\n{self.text()}\n")
        except FileExistsError:
            raise ConfigError(f"{path} already exists; pass --force to replace it") from None
        except OSError as e:
            raise ConfigError(f"cannot write certificate {path}: {e.strerror}") from e

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Certificate:
        """Read a certificate file; ConfigError naming the file if it is unreadable or not a certificate."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read certificate {path}: {e}") from e
        try:
            return parse_certificate(text)
        except ProtocolError as e:
            raise ConfigError(f"{path}: {e}") from e


def issue(cluster: Identity, worker_id: str, not_after: int = 0) -> Certificate:
    """The certificate by which `cluster` vouches for `worker_id` until `not_after` (0: no end)."""
    if type(not_after) is not int or not 0 <= not_after < _MAX_TIME:
        raise ProtocolError(f"not_after must be Unix seconds in 0..2^62, got {not_after!r}")
    unsigned = Certificate(cluster.node_id, worker_id, not_after, b"")
    return Certificate(cluster.node_id, worker_id, not_after, cluster.sign(LABEL + unsigned.body))


def decode_certificate(data: bytes) -> Certificate:
    """The certificate in `data`: ProtocolError if malformed, AuthError if its signature does not verify."""
    if len(data) > MAX_CERTIFICATE:
        raise ProtocolError(f"certificate of {len(data)} bytes exceeds {MAX_CERTIFICATE}")
    outer = _unpack(data, "certificate")
    if not (isinstance(outer, list) and len(outer) == 3):
        raise ProtocolError("certificate must be [version, body, signature]")
    version, body, signature = outer
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"certificate version {version!r} is not {VERSION}")
    if type(body) is not bytes or type(signature) is not bytes:
        raise ProtocolError("certificate body and signature must be bytes")
    fields = _unpack(body, "certificate body")
    if not (isinstance(fields, list) and len(fields) == 3):
        raise ProtocolError("certificate body must be [cluster key, worker key, not_after]")
    cluster_key, worker_key, not_after = fields
    for key in (cluster_key, worker_key):
        if type(key) is not bytes or len(key) != PUBLIC_KEY_SIZE:
            raise ProtocolError(f"certificate keys must be {PUBLIC_KEY_SIZE} bytes")
    if type(not_after) is not int or not 0 <= not_after < _MAX_TIME:
        raise ProtocolError("certificate not_after must be Unix seconds in 0..2^62")
    if not verify(cluster_key, signature, LABEL + body):
        raise AuthError(f"certificate is not signed by cluster {node_id_from_public(cluster_key)}")
    cert = Certificate(
        node_id_from_public(cluster_key), node_id_from_public(worker_key), not_after, signature
    )
    if cert.body != body:  # one certificate, one encoding
        raise ProtocolError("certificate body is not in canonical form")
    return cert


def parse_certificate(text: str) -> Certificate:
    """The certificate in a certificate file's text (see the rules above)."""
    lines = [line.strip() for line in text.splitlines()]
    entries = [line for line in lines if line and not line.startswith("#")]
    if len(entries) != 1 or not entries[0].startswith(TEXT_PREFIX):
        raise ProtocolError(f"a certificate file holds one line starting {TEXT_PREFIX!r}")
    encoded = entries[0][len(TEXT_PREFIX) :]
    try:
        data = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError) as e:
        raise ProtocolError("certificate is not valid base64url") from e
    return decode_certificate(data)


def _unpack(data: bytes, what: str) -> object:
    n = len(data)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=0,
            max_bin_len=min(MAX_CERTIFICATE, n),
            max_array_len=3,
            max_map_len=0,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"{what} is not valid msgpack: {e}") from e


__all__ = [
    "LABEL",
    "MAX_CERTIFICATE",
    "TEXT_PREFIX",
    "Certificate",
    "decode_certificate",
    "issue",
    "parse_certificate",
]

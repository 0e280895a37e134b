"""Signed envelopes: the msgpack array `[version, body, signature]` that presence messages and cluster
certificates travel in; the outer array and bounded decoding only, no keys, no I/O.

Rules:
- An envelope is exactly `[version, body, signature]`: an int version, the body's msgpack bytes,
  and the signer's Ed25519 signature over the format's label ‖ body.
- Opening one checks its size, shape, version and types; decoding the body, and verifying the
  signature with the key the body names, is the format's own step.
- Every decode is bounded: strings, bytes and arrays no longer than the caller's limits or the
  input, no maps, no extension types.
"""

from __future__ import annotations

import msgpack

from emberlink.errors import ProtocolError


def pack_signed(version: int, body: bytes, signature: bytes) -> bytes:
    """The envelope of `body` and its `signature`."""
    data: bytes = msgpack.packb([version, body, signature], use_bin_type=True)
    return data


def open_signed(data: bytes, *, what: str, version: int, max_size: int) -> tuple[bytes, bytes]:
    """(body, signature) of the envelope in `data`; ProtocolError naming `what` if it is malformed."""
    if len(data) > max_size:
        raise ProtocolError(f"{what} of {len(data)} bytes exceeds {max_size}")
    outer = unpack_bounded(data, what, max_str=0, max_bin=max_size, max_array=3)
    if not (isinstance(outer, list) and len(outer) == 3):
        raise ProtocolError(f"{what} must be [version, body, signature]")
    found, body, signature = outer
    if type(found) is not int or found != version:
        raise ProtocolError(f"{what} version {found!r} is not {version}")
    if type(body) is not bytes or type(signature) is not bytes:
        raise ProtocolError(f"{what} body and signature must be bytes")
    return body, signature


def unpack_bounded(data: bytes, what: str, *, max_str: int, max_bin: int, max_array: int) -> object:
    """The msgpack value in `data`, within the limits (and the input's length); ProtocolError if not."""
    n = len(data)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=min(max_str, n),
            max_bin_len=min(max_bin, n),
            max_array_len=min(max_array, n),
            max_map_len=0,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"{what} is not valid msgpack: {e}") from e


__all__ = ["open_signed", "pack_signed", "unpack_bounded"]

"""Wire error codes: one enum, each code raising its own exception, the wire form a plain string."""

from __future__ import annotations

import pytest

from emberlink.errors import ErrorCode, QuotaExceeded, RemoteError
from emberlink.protocol import messages as m


def _remote_error_classes() -> list[type[RemoteError]]:
    found: list[type[RemoteError]] = [RemoteError]
    for cls in found:
        found.extend(cls.__subclasses__())
    return found


def test_every_remote_error_class_has_its_own_code_from_the_enum() -> None:
    codes = {cls: cls.code for cls in _remote_error_classes()}
    assert all(isinstance(code, ErrorCode) for code in codes.values())
    assert sorted(codes.values()) == sorted(ErrorCode)  # one class per code, every code used


@pytest.mark.parametrize("code", list(ErrorCode))
def test_an_error_code_off_the_wire_raises_the_class_that_owns_it(code: ErrorCode) -> None:
    error = RemoteError.from_wire(str(code), "what happened")
    assert type(error).code == code and error.code == code and error.message == "what happened"


def test_an_error_code_travels_as_its_plain_string() -> None:
    as_enum = m.encode_reply(m.Reply(3, (m.Error(7, ErrorCode.QUOTA, "too big"),)))
    assert as_enum == m.encode_reply(m.Reply(3, (m.Error(7, "quota", "too big"),)))
    (decoded,) = m.decode_reply(as_enum).messages
    assert type(decoded) is m.Error and type(decoded.code) is str and decoded.code == "quota"
    assert isinstance(RemoteError.from_wire(decoded.code, decoded.message), QuotaExceeded)


def test_a_code_this_version_does_not_know_stays_a_plain_remote_error_with_that_code() -> None:
    error = RemoteError.from_wire("rate_limited", "slow down")
    assert type(error) is RemoteError and error.code == "rate_limited"

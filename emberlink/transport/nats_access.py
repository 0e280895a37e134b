"""How this process reaches a NATS relay: its credentials file, the CA for TLS, and the connection itself;
never reads what crosses it, and never puts a secret in a message, a log line or an error.

Credentials are a file, never a value on a command line or in an environment variable: an nkey
seed file (one line, `SU...`, what `emberlink cluster nats-user` writes) or a JWT `.creds` file
(what `nsc` writes). The file must not be readable by group or others, like a key file.

A relay that requires TLS (a `tls {}` block in its config) gets TLS from any client: nats-py
upgrades the connection when the server asks, verifying the server against the system's CAs or
the `ca` bundle given here. `nats://` URLs stay the same.

A client's settings come from the environment (`EMBERLINK_NATS_CREDS`, `EMBERLINK_NATS_CA`: file
paths); a worker's from its flags (`--nats-creds`, `--nats-ca`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import stat
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

try:
    import nats.errors
    from nats.aio.client import Client
except ImportError as e:  # nats-py is an optional dependency
    raise ImportError("the NATS relay transport needs nats-py: pip install 'emberlink[nats]'") from e

from emberlink.errors import ConfigError, TransportError

log = logging.getLogger("emberlink.transport.nats")

CREDS_ENV = "EMBERLINK_NATS_CREDS"
CA_ENV = "EMBERLINK_NATS_CA"
ANONYMOUS = "anon"
"""The user part of a client's subjects when it connects without credentials."""

#: How often the NATS client itself pings the server, and how many unanswered pings end it.
_PING_INTERVAL_S = 1
_MAX_OUTSTANDING_PINGS = 2
_JWT_MARK = "-----BEGIN NATS USER JWT-----"
_SEED_BLOCK = re.compile(r"-----BEGIN USER NKEY SEED-----\s*(\S+)\s*------END USER NKEY SEED------")
_MAX_CREDS = 64 * 1024
_CLOSE_AFTER_FAILURE_S = 1.0


def redact(url: str) -> str:
    """The url without user:password, for messages and logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True, slots=True)
class RelayAccess:
    """Credentials file and TLS CA bundle for a relay; both optional (an open relay needs neither)."""

    creds: Path | None = None
    ca: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RelayAccess:
        """The client's settings: $EMBERLINK_NATS_CREDS and $EMBERLINK_NATS_CA (file paths; unset or
        empty means none)."""
        creds, ca = env.get(CREDS_ENV, "").strip(), env.get(CA_ENV, "").strip()
        return cls(Path(creds).expanduser() if creds else None, Path(ca).expanduser() if ca else None)

    def _read_creds(self) -> tuple[str, bool]:
        """(the nkey seed, whether the file is a JWT .creds file); ConfigError naming only the path."""
        path = self.creds
        if path is None:
            raise ConfigError("no NATS credentials file configured")
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"NATS credentials {path} is not a regular file")
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"NATS credentials {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                    f"chmod 600 {path}"
                )
            if st.st_size > _MAX_CREDS:
                raise ConfigError(f"NATS credentials {path} is {st.st_size} bytes: not a credentials file")
            text = path.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not ASCII text"
            raise ConfigError(f"cannot read NATS credentials {path}: {why}") from None
        if _JWT_MARK in text:
            found = _SEED_BLOCK.search(text)
            if found is None:
                raise ConfigError(f"NATS credentials {path} has a JWT but no user nkey seed")
            return found.group(1), True
        seed = text.strip()
        if not seed.startswith("SU") or len(seed.split()) != 1:
            raise ConfigError(
                f"NATS credentials {path} is neither an nkey user seed (SU...) nor a .creds file"
            )
        return seed, False

    def user(self) -> str:
        """The relay user this process connects as: its public nkey (U...), or "anon" without
        credentials. It names the subjects a client listens on, so NATS permissions can keep each
        user to its own."""
        if self.creds is None:
            return ANONYMOUS
        seed, _ = self._read_creds()
        return public_nkey(seed, str(self.creds))

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's `connect` (paths, never secrets themselves)."""
        options: dict[str, Any] = {}
        if self.creds is not None:
            seed, is_jwt = self._read_creds()
            public_nkey(seed, str(self.creds))  # a bad seed is a clear error here, not nats-py's later
            options["user_credentials" if is_jwt else "nkeys_seed"] = str(self.creds)
        if self.ca is not None:
            try:
                options["tls"] = ssl.create_default_context(cafile=str(self.ca))
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"cannot load the relay's CA bundle {self.ca}: {e}") from e
        return options


def public_nkey(seed: str, where: str) -> str:
    """The public key (U...) of an nkey user seed; ConfigError naming `where`, never the seed."""
    try:
        import nkeys
    except ImportError as e:
        raise ConfigError(
            f"NATS credentials need the nkeys package: pip install 'emberlink[nats]' ({e})"
        ) from e
    try:
        pair = nkeys.from_seed(bytearray(seed.encode()))
        public: str = pair.public_key.decode()
        pair.wipe()
    except Exception as e:  # nkeys raises its own errors and binascii's, all meaning "not a seed"
        raise ConfigError(f"NATS credentials {where} does not hold a valid nkey seed") from e
    if not public.startswith("U"):
        raise ConfigError(
            f"NATS credentials {where} is not a user nkey (its public key starts {public[0]!r})"
        )
    return public


def create_user_seed(path: Path, *, overwrite: bool = False) -> str:
    """Write a new nkey user seed to `path` (mode 0600, never over an existing file unless `overwrite`);
    returns its public key (U...), the one the relay's configuration names."""
    try:
        import nkeys
    except ImportError as e:
        raise ConfigError(
            f"NATS credentials need the nkeys package: pip install 'emberlink[nats]' ({e})"
        ) from e
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode("ascii")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} already exists; pass --force to replace it") from None
    except OSError as e:
        raise ConfigError(f"cannot write NATS credentials {path}: {e.strerror}") from e
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(seed + "\n")
    return public_nkey(seed, str(path))


async def open_connection(
    url: str,
    timeout: float,
    on_lost: Callable[[Client], Awaitable[None]],
    access: RelayAccess,
    *,
    inbox_prefix: str | None = None,
) -> Client:
    """A NATS connection that never reconnects by itself: a lost relay ends it, and `on_lost` runs."""
    nc = Client()

    async def lost() -> None:
        await on_lost(nc)

    errors_seen: list[Exception] = []

    async def error(e: Exception) -> None:
        errors_seen[:] = [e]
        log.debug("nats %s: %s: %s", redact(url), type(e).__name__, e)

    options = access.connect_options()
    if inbox_prefix is not None:
        options["inbox_prefix"] = inbox_prefix
    try:
        await nc.connect(
            servers=[url],
            allow_reconnect=False,
            connect_timeout=timeout,  # type: ignore[arg-type]
            # 0 would mean "forever" to nats-py's first connect; 1 means two quick tries, then give up.
            max_reconnect_attempts=1,
            reconnect_time_wait=0.05,  # type: ignore[arg-type]
            ping_interval=_PING_INTERVAL_S,
            max_outstanding_pings=_MAX_OUTSTANDING_PINGS,
            disconnected_cb=lost,
            closed_cb=lost,
            error_cb=error,
            **options,
        )
    except (OSError, TimeoutError, nats.errors.Error) as e:
        # nats-py reports "no servers" after its attempts; the last attempt's error says why.
        cause = errors_seen[0] if isinstance(e, nats.errors.NoServersError) and errors_seen else e
        try:
            # nats-py's close never returns after a failed TLS handshake (2.16): do not wait forever.
            await asyncio.wait_for(nc.close(), _CLOSE_AFTER_FAILURE_S)
        except TimeoutError:
            pass
        what = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        raise TransportError(f"cannot reach NATS relay at {redact(url)}: {what}") from e
    return nc


__all__ = [
    "ANONYMOUS",
    "CA_ENV",
    "CREDS_ENV",
    "RelayAccess",
    "create_user_seed",
    "open_connection",
    "public_nkey",
    "redact",
]

"""Picking a worker on a NATS relay: collect the workers' signed presence, keep those this client trusts
(client/trust.py), try them least loaded first, skip those that refuse this client; never picks a
worker it does not trust, and never sends anything that names the client to the relay.

`Device.remote("nats://host:4222")` lands here (through client/address.py's `open_remote`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from emberlink.client.remote import RemoteExecutor, connect_ticket, load_client_identity
from emberlink.client.trust import CLUSTER_ENV, CLUSTER_MARKER, Trust, default_known_workers_path
from emberlink.errors import AuthError, ProtocolError, TransportError, WorkerLost
from emberlink.protocol.presence import NONCE_SIZE, Presence, decode_presence
from emberlink.protocol.ticket import Ticket
from emberlink.transport.loop import io_loop

log = logging.getLogger("emberlink.client")

WINDOW_S = 2.5
"""The longest discovery listens: every worker publishes presence at least this often (every 2 s)."""
QUIET_S = 0.5
"""Discovery ends this long after the last new answer to its query."""


@dataclass(frozen=True, slots=True)
class Seen:
    """A worker as discovery saw it: its presence and its ticket, with the relay it was seen on."""

    presence: Presence
    ticket: Ticket

    @property
    def node_id(self) -> str:
        return self.ticket.node_id


def survey(url: str, *, window: float = WINDOW_S, quiet: float = QUIET_S, timeout: float = 5.0) -> list[Seen]:
    """Every worker that answered this survey's query on the relay at `url`, least loaded first.

    Ties are broken at random, so clients that see the same loads spread over the workers. Only
    answers that sign back this query's fresh nonce count: periodic messages, and answers recorded
    earlier and replayed, say nothing about whether the worker is there now. Messages that do not
    decode or whose signature does not verify are ignored.
    """
    from emberlink.transport.presence import query  # nats-py is an optional dependency

    _check_url(url)
    nonce = os.urandom(NONCE_SIZE)
    heard = io_loop().call(
        query(url, window=window, quiet=quiet, timeout=timeout, payload=nonce), window + timeout + 1
    )
    latest: dict[str, Presence] = {}
    for message in heard:
        try:
            presence = decode_presence(message.data)
            node_id = presence.node_id
        except ProtocolError as e:  # AuthError included: someone spoke for a key it does not hold
            log.debug("ignoring a presence message on %s: %s", message.subject, e)
            continue
        if presence.nonce != nonce:
            log.debug("ignoring an answer from %s that is not for this query (replayed?)", node_id)
            continue
        if node_id not in latest or presence.seq >= latest[node_id].seq:
            latest[node_id] = presence
    seen = [Seen(p, _via(Ticket.parse(p.ticket), url)) for p in latest.values()]
    random.shuffle(seen)
    seen.sort(key=lambda s: s.presence.load)  # stable: equal loads keep the shuffled order
    return seen


def _via(ticket: Ticket, url: str) -> Ticket:
    """The ticket with the relay it was seen on: the worker's own relay URL may be a name only
    its network resolves (`nats://nats:4222` inside a compose file)."""
    try:
        return dataclasses.replace(ticket, relay=url)
    except ProtocolError:  # e.g. user:password in the URL, which a ticket cannot carry
        return ticket


def _check_url(url: str) -> None:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "nats" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise TransportError(f"{url!r} is not a relay address: write nats://host:port")


def open_discovered(
    address: str,
    *,
    key: str | os.PathLike[str] | None = None,
    timeout: float = 30.0,
    trust: Trust | None = None,
) -> RemoteExecutor:
    """A session with the least-loaded worker on relay `address` that this client trusts and that admits it.

    `trust` defaults to the client's settings (`Trust.load()`). AuthError if workers were seen but
    none is trusted (the message names each and says how to trust it), or none of the trusted ones
    admitted this client; TransportError if none was seen or none could be reached. The messages
    say how many workers were seen.
    """
    trust = trust if trust is not None else Trust.load()
    identity = load_client_identity(key)
    deadline = time.monotonic() + timeout
    candidates = [s for s in survey(address, window=min(WINDOW_S, timeout)) if not s.presence.draining]
    if not candidates:
        raise TransportError(
            f"no worker answered on relay {address} (0 workers seen): are workers started with "
            f"--relay {address}?"
        )
    now = time.time()
    trusted = [s for s in candidates if trust.why(s.presence, now) is not None]
    if not trusted:
        raise AuthError(untrusted_message(address, candidates, trust, now))
    refused: list[str] = []
    failed: list[str] = []
    for seen in trusted:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            failed.append(f"{seen.node_id[:12]}: not tried, out of time ({timeout} s)")
            break
        try:
            executor = connect_ticket(seen.ticket, identity, timeout=remaining)
        except AuthError as e:
            log.info("worker %s does not admit this client: %s", seen.node_id, e)
            refused.append(seen.node_id)
            continue
        except (TransportError, WorkerLost) as e:
            log.info("worker %s could not be reached: %s", seen.node_id, e)
            failed.append(f"{seen.node_id[:12]}: {e}")
            continue
        log.info(
            "discovery on %s picked worker %s (load %s, trusted: %s)",
            address,
            seen.node_id,
            seen.presence.load,
            trust.why(seen.presence, now),
        )
        return executor
    n = len(trusted)
    if refused and not failed:
        raise AuthError(
            f"none of the {n} trusted worker(s) seen on relay {address} admits this client "
            f"({identity.node_id}): add its NodeId to a worker's allow file"
        )
    raise TransportError(
        f"no usable worker on relay {address}: {n} trusted seen, {len(refused)} refused this client "
        f"({identity.node_id}), {len(failed)} unreachable: " + "; ".join(failed)
    )


def untrusted_message(address: str, seen: list[Seen], trust: Trust, now: float) -> str:
    """Why discovery picked nobody: what it saw, what it trusts, and how to trust a worker."""
    listing = "; ".join(f"{s.node_id} ({_certificate_text(s.presence, now)})" for s in seen)
    if trust.empty:
        head = f"{len(seen)} worker(s) seen on relay {address}, but this client trusts no worker yet"
    else:
        head = f"none of the {len(seen)} worker(s) seen on relay {address} is trusted ({trust.source})"
    return (
        f"{head}. Seen: {listing}. To trust a worker, add its NodeId to "
        f"{trust.path or default_known_workers_path()} "
        f"(one a line); to trust every worker a cluster signs, add `{CLUSTER_MARKER} <cluster-id>` "
        f"there or set {CLUSTER_ENV}=<cluster-id>"
    )


def _certificate_text(presence: Presence, now: float) -> str:
    cert = presence.certificate
    if cert is None:
        return "no cluster certificate"
    expired = cert.not_after != 0 and now > cert.not_after
    return f"{'expired certificate of' if expired else 'signed by'} cluster {cert.cluster_id}"


__all__ = ["QUIET_S", "WINDOW_S", "Seen", "open_discovered", "survey", "untrusted_message"]

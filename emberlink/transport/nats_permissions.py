"""The NATS permissions of each role on a relay, written as nats-server configuration; no I/O.

A worker may subscribe to its own session requests, its own session inboxes and discovery
queries, and publish its own presence and to clients' inboxes; it answers requests through
`allow_responses`. A client may publish session requests, to workers' inboxes and discovery
queries, and subscribe to its own inboxes only (they carry its relay user's public nkey). So a
worker cannot read another's sessions or speak for it, and a client cannot read or write
anything but its own sessions and what every client may send.
"""

from __future__ import annotations

import json
from enum import Enum

from emberlink.transport.nats import INBOX_PREFIX, NODE_PREFIX, TO_CLIENT_PREFIX, TO_WORKER_PREFIX, _token
from emberlink.transport.presence import PRESENCE_PREFIX, QUERY_SUBJECT


class Role(Enum):
    WORKER = "worker"
    CLIENT = "client"


def permissions(role: Role, user: str, node_id: str | None = None) -> dict[str, object]:
    """The `permissions` map of relay user `user` (a public nkey) in `role`; a worker's names its NodeId."""
    _token(user, "relay user")
    if role is Role.WORKER:
        if node_id is None:
            raise ValueError("a worker's permissions name its NodeId")
        _token(node_id, "node id")
        return {
            "publish": {"allow": [PRESENCE_PREFIX + node_id, TO_CLIENT_PREFIX + "*.*"]},
            "subscribe": {"allow": [NODE_PREFIX + node_id, f"{TO_WORKER_PREFIX}{node_id}.*", QUERY_SUBJECT]},
            "allow_responses": True,
        }
    return {
        "publish": {"allow": [NODE_PREFIX + "*", TO_WORKER_PREFIX + "*.*", QUERY_SUBJECT]},
        "subscribe": {"allow": [f"{TO_CLIENT_PREFIX}{user}.*", f"{INBOX_PREFIX}{user}.>"]},
    }


def user_entry(role: Role, user: str, node_id: str | None = None) -> str:
    """One entry of nats-server's `authorization { users = [...] }` for `user` (JSON is valid there)."""
    what = f"worker {node_id}" if role is Role.WORKER else "client"
    entry = {"nkey": user, "permissions": permissions(role, user, node_id)}
    return f"# emberlink {what}\n{json.dumps(entry)}"


def add_user(conf: str, entry: str) -> str:
    """The text of a users file (`users = [ ... ]`, included by deploy/nats.conf) with `entry` added;
    an empty text starts a new one. ValueError if the text is not such a file."""
    if not conf.strip():
        return f"users = [\n{entry}\n]\n"
    body = conf.rstrip()
    if not body.endswith("]") or "users" not in body:
        raise ValueError("not a users file: it should be `users = [ ... ]`")
    return f"{body[:-1].rstrip()}\n{entry}\n]\n"


__all__ = ["Role", "add_user", "permissions", "user_entry"]

"""Which workers found on a relay this client trusts: its known-workers file and the clusters it was given;
reads those settings and judges presence, never talks to the network.

Discovery picks only trusted workers (client/discovery.py). A worker is trusted when its NodeId
is a known worker, or when its presence carries a certificate, in date, from a trusted cluster.

The known-workers file (`$EMBERLINK_KNOWN_WORKERS`, else ~/.config/emberlink/known_workers) is
read like SSH's known_hosts: one entry a line, blank lines and `#` comments ignored, where an
entry is a worker's NodeId, or `@cluster <cluster-id>` to trust every worker that cluster signs.
`$EMBERLINK_CLUSTER` adds cluster ids (separated by commas or spaces). A file that is missing is
no entries; a malformed line is a ConfigError naming file and line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from emberlink.errors import ConfigError, ProtocolError
from emberlink.protocol.identity import public_from_node_id
from emberlink.protocol.presence import Presence

KNOWN_WORKERS_ENV = "EMBERLINK_KNOWN_WORKERS"
CLUSTER_ENV = "EMBERLINK_CLUSTER"
CLUSTER_MARKER = "@cluster"


def default_known_workers_path(env: Mapping[str, str] = os.environ) -> Path:
    """$EMBERLINK_KNOWN_WORKERS, else ~/.config/emberlink/known_workers."""
    configured = env.get(KNOWN_WORKERS_ENV, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".config" / "emberlink" / "known_workers"


def _checked(node_id: str, what: str) -> str:
    try:
        public_from_node_id(node_id)
    except ProtocolError as e:
        raise ConfigError(f"{what}: {e}") from e
    return node_id


@dataclass(frozen=True, slots=True)
class Trust:
    """Trusted worker NodeIds and cluster ids; `source` says where they came from and `path` is the
    known-workers file read (if one was), for messages."""

    workers: frozenset[str] = frozenset()
    clusters: frozenset[str] = frozenset()
    source: str = "no trust configured"
    path: Path | None = None

    @classmethod
    def of(cls, workers: Iterable[str] = (), clusters: Iterable[str] = ()) -> Trust:
        """Trust exactly these (e.g. from a program's own configuration); ConfigError on a malformed id."""
        w = frozenset(_checked(n, "trusted worker") for n in workers)
        c = frozenset(_checked(n, "trusted cluster") for n in clusters)
        return cls(w, c, "given by the program")

    @classmethod
    def load(cls, env: Mapping[str, str] = os.environ) -> Trust:
        """The client's settings: the known-workers file and $EMBERLINK_CLUSTER."""
        path = default_known_workers_path(env)
        workers, clusters = read_known_workers(path)
        source = f"{path} ({len(workers)} worker(s), {len(clusters)} cluster(s))"
        from_env = {
            _checked(c, f"${CLUSTER_ENV}") for c in re.split(r"[\s,]+", env.get(CLUSTER_ENV, "")) if c
        }
        if from_env:
            source += f" and ${CLUSTER_ENV} ({len(from_env)} cluster(s))"
        return cls(frozenset(workers), frozenset(clusters | from_env), source, path)

    @property
    def empty(self) -> bool:
        return not self.workers and not self.clusters

    def why(self, presence: Presence, now: float) -> str | None:
        """Why this client trusts the worker of `presence` ("known worker", "cluster <id>"), or None."""
        node_id = presence.node_id
        if node_id in self.workers:
            return "known worker"
        cert = presence.certificate
        if cert is not None and cert.vouches_for(node_id, self.clusters, now):
            return f"cluster {cert.cluster_id}"
        return None


def read_known_workers(path: Path) -> tuple[set[str], set[str]]:
    """(worker NodeIds, cluster ids) in a known-workers file; both empty if there is no file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return set(), set()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read known-workers file {path}: {e}") from e
    workers: set[str] = set()
    clusters: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        where = f"{path}:{lineno}"
        if not words:
            continue
        if words[0] == CLUSTER_MARKER and len(words) == 2:
            clusters.add(_checked(words[1], f"{where}: not a cluster id"))
        elif len(words) == 1 and not words[0].startswith("@"):
            workers.add(_checked(words[0], f"{where}: not a NodeId"))
        else:
            raise ConfigError(f"{where}: expected a worker NodeId or `{CLUSTER_MARKER} <cluster-id>`")
    return workers, clusters


__all__ = ["CLUSTER_ENV", "KNOWN_WORKERS_ENV", "Trust", "default_known_workers_path", "read_known_workers"]

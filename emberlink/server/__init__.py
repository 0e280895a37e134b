"""The worker: sessions over any transport Link, a tensor store per session, one device thread.

worker.py      Worker: what sessions share (identity, allow policy, device, graph cache, stats)
session.py     one session's event-loop half: handshake, frames in and out, bulk buffers
runner.py      one session's device-thread half: applies batches in order (section 6)
store.py       tensor store and byte quotas
graphs.py      one client's view of the shared graph cache
device.py      the backend and the single thread that runs all of its work
daemon.py      `emberlink worker`: flags, listeners, ticket, signals
background.py  a worker inside this process (demo, tests, benches)
demo.py        `emberlink demo`
relay.py, presence.py   serving through a NATS relay and publishing presence
"""

"""A client script for the relay tests, run as its own process.

python -m tests.relay.relay_client ADDRESS KEY train STEPS
    prints "connected WORKER PATH", then "losses [...]"
python -m tests.relay.relay_client ADDRESS KEY loop
    prints "connected WORKER PATH", trains until "stop" on stdin ("done STEPS", exit 0) or the
    session dies ("lost TYPE: MESSAGE", exit 3)
--probe HOST:PORT (first) prints "probe ok" or "probe failed: ..." for a plain TCP connect first.
(Run from the repository root, or with it on PYTHONPATH: relay_harness.client_process does that.)
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import emberlink as el
from tests.relay import relay_training


def probe(target: str) -> None:
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        print("probe ok", flush=True)
    except OSError as e:
        print(f"probe failed: {e}", flush=True)


def main(argv: list[str]) -> int:
    if argv[0] == "--probe":
        probe(argv[1])
        argv = argv[2:]
    address, key, mode = argv[:3]
    dev = el.Device.remote(address, key=key, timeout=20)
    stats = dev.stats()
    print(f"connected {stats['worker']} {stats['path']}", flush=True)
    if mode == "train":
        print("losses " + json.dumps(relay_training.train(dev, int(argv[3]))), flush=True)
        dev.close()
        return 0
    stop = threading.Event()

    def stop_on_a_line_of_stdin() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=stop_on_a_line_of_stdin, daemon=True).start()
    model, opt = relay_training.make_model(dev)
    data = relay_training.batches(4)
    steps = 0
    try:
        while not stop.is_set():
            x, y = data[steps % len(data)]
            relay_training.step(dev, model, opt, x, y)
            steps += 1
            print(f"step {steps}", flush=True)
            time.sleep(0.02)  # leave the two cores to the other processes
        relay_training.step(dev, model, opt, *data[0])  # the session still works after "stop"
    except el.WorkerLost as e:
        print(f"lost {type(e).__name__}: {e}", flush=True)
        return 3
    print(f"done {steps}", flush=True)
    dev.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""A training client for the chaos tests, run as its own process (often inside a network namespace).

python -m tests.chaos.chaos_client ADDRESS KEY STEPS PACE
    prints "connected PATH", then "step I T" after each step (T: time.monotonic() when its loss
    arrived; the clock is system-wide, so the test compares it with its own), then "losses [...]"
    and "stats {...}" (dev.stats() as JSON); a WorkerLost prints "lost MESSAGE" and exits 3.
PACE: seconds to sleep after each step (leaves the two cores to the other processes).
"""

from __future__ import annotations

import json
import sys
import time

import emberlink as el
from tests.relay import relay_training


def main(argv: list[str]) -> int:
    address, key, steps, pace = argv[0], argv[1], int(argv[2]), float(argv[3])
    dev = el.Device.remote(address, key=key, timeout=20)
    print(f"connected {dev.stats()['path']}", flush=True)
    model, opt = relay_training.make_model(dev)
    losses = []
    try:
        for i, (x, y) in enumerate(relay_training.batches(steps)):
            losses.append(relay_training.step(dev, model, opt, x, y))
            print(f"step {i} {time.monotonic():.4f}", flush=True)
            time.sleep(pace)
    except el.WorkerLost as e:
        print(f"lost {e}", flush=True)
        return 3
    print("losses " + json.dumps(losses), flush=True)
    print("stats " + json.dumps(dev.stats()), flush=True)
    dev.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

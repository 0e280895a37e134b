"""When each mark of a traced remote step comes, from the step's start: bench/step_trace.py's run, per blob.

    python bench/step_timeline.py --device cpu --transport tcp --step upload --cpus split
    python bench/step_timeline.py --device cuda:0 --transport tcp --step mlp --cpus any

Takes bench/step_trace.py's arguments and runs it as is (its tables come after), and first prints,
for each feed, the median time from the step's start of the k-th occurrence of each mark in a
step: the client's writes (`c.write#k` .. `c.written#k`, one per blob of a pipelined upload), the
worker's arrivals (`w.recv#k`), the batch whole (`w.submit`), applied, the reply sent (`w.post`)
and the client's answer (`c.resolve`). step_trace's stages give each gap alone; this shows which
side a pipelined upload waits for: if the worker's arrivals trail the client's writes by more and
more, the worker opens chunks slower than the client seals and writes them, and a faster client
would not end the upload sooner; a first arrival long after the first write is the worker's wake-up.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_trace

SHOWN = (
    "c.flush",
    "c.submit",
    "c.write",
    "c.written",
    "w.recv",
    "w.submit",
    "w.apply",
    "w.applied",
    "w.post",
    "c.resolve",
    "c.done",
)
_durations = step_trace.durations


def timeline(events: list[tuple[str, int]], warm: int) -> dict[str, list[float]]:
    """Print the timeline of the steps in `events`, then return step_trace's stages of them."""
    ordered = sorted(events, key=lambda e: e[1])
    starts = [i for i, (tag, _) in enumerate(ordered) if tag == "c.step"]
    times: dict[str, list[float]] = {}
    for a, b in itertools.pairwise(starts[warm:]):
        step = ordered[a:b]
        t0 = step[0][1]
        seen: dict[str, int] = {}
        for tag, ns in step:
            k = seen.get(tag, 0)
            seen[tag] = k + 1
            if tag in SHOWN:
                times.setdefault(f"{tag}#{k}", []).append((ns - t0) / 1e3)
    steps = max(len(starts) - warm - 1, 1)
    print("\n| mark (its k-th time in the step) | median µs from the step's start | in % of steps |")
    print("|---|---:|---:|")
    for name in sorted(times, key=lambda n: statistics.median(times[n])):
        values = times[name]
        print(f"| {name} | {statistics.median(values):.0f} | {100 * len(values) // steps} |")
    return _durations(events, warm)


def main() -> None:
    step_trace.durations = timeline
    sys.argv[0] = "step_trace.py"
    step_trace.main()


if __name__ == "__main__":
    main()

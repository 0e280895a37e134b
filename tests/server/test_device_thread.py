"""DeviceThread: inline work runs only when the device is idle, and stays serialized with posted work;
lanes (sessions) take turns."""

from __future__ import annotations

import threading

from emberlink.server.device import AGAIN, DeviceThread, Turn


def test_inline_work_is_declined_while_posted_work_is_queued_or_running() -> None:
    device = DeviceThread("cpu")
    try:
        release = threading.Event()
        started = threading.Event()

        def block() -> None:
            started.set()
            release.wait(5)

        device.post(block)
        device.post(lambda: None)
        started.wait(5)
        assert device.run_here_if_idle(lambda: True) is False
        release.set()
        device.submit(lambda: None).result(5)
        ran_on: list[threading.Thread] = []

        def note_thread() -> bool:
            ran_on.append(threading.current_thread())
            return True

        assert device.run_here_if_idle(note_thread) is True
        assert ran_on == [threading.current_thread()]
        assert device.run_here_if_idle(lambda: False) is False  # the work itself may decline
    finally:
        device.shutdown()


def test_work_posted_during_inline_work_runs_after_it() -> None:
    device = DeviceThread("cpu")
    try:
        order: list[str] = []

        def inline() -> bool:
            fut = device.submit(order.append, "posted")
            assert not fut.done()  # the device thread waits for the inline work
            threading.Event().wait(0.05)
            order.append("inline")
            return True

        assert device.run_here_if_idle(inline)
        device.submit(lambda: None).result(5)
        assert order == ["inline", "posted"]
    finally:
        device.shutdown()


def test_an_idle_device_thread_keeps_nothing_of_its_last_item_alive() -> None:
    import gc
    import weakref

    device = DeviceThread("cpu")
    try:

        class Payload:
            pass

        payload = Payload()
        ref = weakref.ref(payload)
        device.submit(lambda p: None, payload).result(5)
        del payload
        for _ in range(100):  # the thread lets go just after the result is set
            gc.collect()
            if ref() is None:
                break
            threading.Event().wait(0.01)
        assert ref() is None
    finally:
        device.shutdown()


def test_lanes_take_turns_one_item_each() -> None:
    device = DeviceThread("cpu")
    try:
        gate = threading.Event()
        device.post(gate.wait, 5)  # everything below is queued before anything runs
        order: list[str] = []
        busy, other = device.lane("busy"), device.lane("other")
        for i in range(3):
            busy.post(order.append, f"busy {i}")
        other.post(order.append, "other 0")
        gate.set()
        busy.submit(lambda: None).result(5)
        assert order == ["busy 0", "other 0", "busy 1", "busy 2"]
    finally:
        device.shutdown()


def test_an_unfinished_item_keeps_its_place_in_its_lane_and_lets_other_lanes_run() -> None:
    device = DeviceThread("cpu")
    try:
        gate = threading.Event()
        device.post(gate.wait, 5)
        order: list[str] = []
        turns = iter(range(3))
        busy, other = device.lane("busy"), device.lane("other")

        def long_batch() -> Turn | None:
            turn = next(turns)
            order.append(f"long {turn}")
            return AGAIN if turn < 2 else None

        busy.post(long_batch)
        busy.post(order.append, "busy after")
        other.post(order.append, "other 0")
        other.post(order.append, "other 1")
        gate.set()
        busy.submit(lambda: None).result(5)
        assert order == ["long 0", "other 0", "long 1", "other 1", "long 2", "busy after"]
        assert device.queued() == 0
    finally:
        device.shutdown()

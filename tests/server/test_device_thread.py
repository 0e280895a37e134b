"""DeviceThread: inline work runs only when the device is idle, and stays serialized with posted work."""

from __future__ import annotations

import threading

from emberlink.server.device import DeviceThread


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

"""The daemon's readers-writer lock: readers share it, a writer is alone, a waiting writer blocks new readers."""

from __future__ import annotations

import threading

from kvtier.server.daemon.locks import RWLock


def test_readers_share_writer_waits():
    lock = RWLock()
    inside = threading.Barrier(3, timeout=10)
    order: list[str] = []

    def reader():
        with lock.shared():
            inside.wait()  # all three readers are inside together, or the barrier times out
            order.append("r")

    readers = [threading.Thread(target=reader) for _ in range(3)]
    with lock.shared():
        pass
    for t in readers:
        t.start()
    for t in readers:
        t.join(10)
    assert order == ["r"] * 3

    held = threading.Event()
    release = threading.Event()

    def writer():
        with lock.exclusive():
            held.set()
            release.wait(10)
            order.append("w")

    w = threading.Thread(target=writer)
    w.start()
    assert held.wait(10)
    r = threading.Thread(target=reader)
    got_in = threading.Event()

    def late_reader():
        with lock.shared():
            got_in.set()
            order.append("late")

    r = threading.Thread(target=late_reader)
    r.start()
    assert not got_in.is_set() or order[-1] == "w"
    release.set()
    w.join(10)
    r.join(10)
    assert order[-2:] == ["w", "late"]  # the reader entered only after the writer left

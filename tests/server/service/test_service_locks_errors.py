"""The readers-writer lock and the one mapping from domain errors to status codes."""

from __future__ import annotations

import threading

import grpc

from kvtier.server.pool import AllocatorError
from kvtier.server.service.errors import (
    AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, status_code_for,
)
from kvtier.server.service.locks import RWLock


def test_status_codes():
    assert status_code_for(InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code_for(NotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status_code_for(AlreadyExists("x")) == grpc.StatusCode.ALREADY_EXISTS
    assert status_code_for(ResourceExhausted("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code_for(FailedPrecondition("x")) == grpc.StatusCode.FAILED_PRECONDITION

    class TierFull(ResourceExhausted):
        pass

    assert status_code_for(TierFull("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED  # subclasses map too
    assert status_code_for(AllocatorError("double free")) == grpc.StatusCode.INVALID_ARGUMENT  # pool core ValueError
    assert status_code_for(RuntimeError("bug")) == grpc.StatusCode.INTERNAL


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

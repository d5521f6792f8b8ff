"""Calls that send their headers and never their request message, for tests that hold a daemon's
worker threads on purpose (structural, not timed)."""

from __future__ import annotations

import threading

import grpc


class StalledCalls:
    """``n`` calls of unary ``method`` that send their headers and never their request message (a
    request iterator that blocks until :meth:`close`), each on a channel of its own."""

    def __init__(self, address: str, method: str, n: int) -> None:
        self.release = threading.Event()
        self.channels = [grpc.insecure_channel(address) for _ in range(n)]
        self.calls = []
        for ch in self.channels:
            call = ch.stream_stream(method, request_serializer=bytes, response_deserializer=bytes)
            self.calls.append(call(self._never(), timeout=120))

    def _never(self):
        self.release.wait(120)
        return
        yield b""  # a generator that yields nothing until released

    def codes(self) -> list[grpc.StatusCode]:
        """How each call ended (waits for each: the daemon must end them, the client never does)."""
        return [call.code() for call in self.calls]

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        for ch in self.channels:
            ch.close()

"""Start a real kvtier daemon as a subprocess (``python -m kvtier.cli serve``) and stop it.

For tests, and for commands that embed a daemon (``kvtier replay``)::

    from kvtier.client.spawn import spawn_daemon
    with spawn_daemon(extra_args=["--pool", "glm-5.2:4096", "--pool-layers", "8"]) as address:
        with KVTierClient(address) as c: ...

:class:`DaemonProcess` is the same with access to the process (exit code, log).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _private(path: str, flags: int) -> int:
    """``open``'s opener for a file of this user alone: created 0600, an existing one made 0600."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


class DaemonProcess:
    """A daemon subprocess: started by :meth:`start` (or ``with``), stopped by :meth:`stop`.

    Args:
        listen: ``unix:///path``, ``HOST:PORT`` (``127.0.0.1:0``: a free port) or None: a unix
            socket in a fresh private temp directory.
        extra_args: more ``kvtier serve`` arguments (``--pool``, ``--host-memory``, ...).
        env: extra environment variables for the daemon.
        startup_timeout: seconds to wait for the health check to say SERVING.
        stop_timeout: seconds to wait after SIGTERM before SIGKILL.
        tls_root_cert: PEM file to check a TLS daemon's certificate with (for the health check).
        tls_server_name: name that certificate is for, if not the address's host.
        tls_client_cert, tls_client_key: client certificate and key for a mutual-TLS daemon's health check.
        allow_unauthenticated: pass ``--allow-unauthenticated`` (a TCP ``listen`` without
            ``--auth-tokens``: every local user may use the daemon; tests and benches on loopback).

    Attributes:
        address: the bound address once started.
        returncode: the exit code once stopped.
        log_path: file with the daemon's stdout and stderr.
    """

    def __init__(self, listen: str | None = None, *, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 startup_timeout: float = 60.0, stop_timeout: float = 30.0,
                 tls_root_cert: str | Path | None = None, tls_server_name: str | None = None,
                 tls_client_cert: str | Path | None = None, tls_client_key: str | Path | None = None,
                 allow_unauthenticated: bool = False) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-daemon-"))
        os.chmod(self._dir, 0o700)
        self.listen = listen or f"unix://{self._dir / 'kvtier.sock'}"
        self.extra_args = [*extra_args, *(["--allow-unauthenticated"] if allow_unauthenticated else [])]
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.log_path = self._dir / "daemon.log"
        self.address = ""
        self.returncode: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.tls_root_cert = tls_root_cert
        self.tls_server_name = tls_server_name
        self.tls_client_cert = tls_client_cert
        self.tls_client_key = tls_client_key

    def start(self) -> str:
        """Start the daemon and wait until it serves; returns its address.

        Raises:
            RuntimeError: it exited or did not serve in time (the message holds its log's tail).
        """
        ready = self._dir / "ready"
        cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--listen", self.listen, "--ready-file", str(ready), *self.extra_args]
        with open(self.log_path, "wb", opener=_private) as log:  # the daemon's log is its user's alone (0600)
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        deadline = time.monotonic() + self.startup_timeout
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode} before serving:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"daemon not ready after {self.startup_timeout}s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.address = ready.read_text().strip()
        self._wait_serving(deadline)
        return self.address

    def _wait_serving(self, deadline: float) -> None:
        if self.tls_root_cert is not None:
            from kvtier.client.base import read_pem_file

            creds = grpc.ssl_channel_credentials(
                root_certificates=read_pem_file(self.tls_root_cert, "tls_root_cert"),
                private_key=read_pem_file(self.tls_client_key, "tls_client_key") if self.tls_client_key else None,
                certificate_chain=read_pem_file(self.tls_client_cert, "tls_client_cert") if self.tls_client_cert else None)
            opts = [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []
            channel = grpc.secure_channel(self.address, creds, options=opts)
        else:
            channel = grpc.insecure_channel(self.address)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"daemon at {self.address} not serving:\n{self.log_tail()}")
                time.sleep(0.05)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` to the daemon (if it is still running)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the daemon to exit; returns its exit code (raises subprocess.TimeoutExpired)."""
        assert self.process is not None
        self.returncode = self.process.wait(timeout)
        return self.returncode

    def stop(self) -> int | None:
        """SIGTERM, wait ``stop_timeout`` seconds, then SIGKILL; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.returncode = self.process.returncode
        return self.returncode

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the daemon's output."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def cleanup(self) -> None:
        """Remove the temp directory (socket, ready file, log)."""
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.cleanup()


@contextmanager
def spawn_daemon(listen: str | None = None, *, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 startup_timeout: float = 60.0) -> Iterator[str]:
    """Run a daemon subprocess for the ``with`` block; yields its address. On exit: SIGTERM and wait.

    Args: see :class:`DaemonProcess`.
    """
    with DaemonProcess(listen, extra_args=extra_args, env=env, startup_timeout=startup_timeout) as d:
        yield d.address

"""Run a real ``mooncake_master`` (with its own HTTP metadata server) on 127.0.0.1, for tests,
benchmarks and a one-machine setup of the Mooncake Store tier::

    from kvtier.mooncake_master import MooncakeMaster

    with MooncakeMaster() as m:                     # free ports; killed on exit
        args = ["--tiers", "host,mooncake", "--mooncake-master", m.master, "--mooncake-metadata", m.metadata]
        ...
        m.kill(); m.start()                         # the same ports again (a master that lost its objects)

The binary is the one the ``mooncake-transfer-engine-non-cuda`` wheel ships inside the ``mooncake``
package (``pip install 'kvtier[mooncake]'``); a missing wheel is an error, never a skip. The master's
own metrics/admin port is moved off its default 9003 too, so several masters can run side by side.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def master_binary() -> Path:
    """Path of the ``mooncake_master`` executable inside the installed ``mooncake`` package.

    Raises:
        FileNotFoundError: the wheel is not installed or has no master binary.
    """
    try:
        import mooncake
    except ImportError as e:
        raise FileNotFoundError("the mooncake package is not installed: pip install 'kvtier[mooncake]' "
                                "(mooncake-transfer-engine-non-cuda)") from e
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise FileNotFoundError(f"no executable mooncake_master at {path}")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _private(path: str, flags: int) -> int:
    """``open``'s opener for a log of this user alone: created 0600, an existing one made 0600."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


class MooncakeMaster:
    """A ``mooncake_master`` subprocess with ``--enable_http_metadata_server`` on 127.0.0.1.

    Args:
        rpc_port, http_port, metrics_port: ports (0: a free one, chosen once and kept across restarts).
        extra_args: more master flags (e.g. ``--default_kv_lease_ttl=1000``).
        log_path: where the master's output goes (default: a temp file, removed by :meth:`cleanup`).

    Attributes:
        master: ``127.0.0.1:<rpc port>`` (``--mooncake-master``).
        metadata: ``http://127.0.0.1:<http port>/metadata`` (``--mooncake-metadata``).
    """

    def __init__(self, *, rpc_port: int = 0, http_port: int = 0, metrics_port: int = 0,
                 extra_args: Sequence[str] = (), log_path: str | Path | None = None) -> None:
        self.binary = master_binary()
        self.rpc_port = rpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.extra_args = list(extra_args)
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def args(self) -> list[str]:
        """The master's command line."""
        return [str(self.binary), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http_port}",
                "--http_metadata_server_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                "--metrics_host=127.0.0.1", "--logtostderr", *self.extra_args]

    def start(self, timeout_s: float = 30.0) -> MooncakeMaster:
        """Start the master (again, on the same ports) and wait until its RPC and HTTP ports answer.

        A master restarted right after a kill can fail to bind its HTTP port and exit; it is started
        again until ``timeout_s`` passes.

        Raises:
            RuntimeError: it did not come up (the message ends with its log).
        """
        if self.process is not None and self.process.poll() is None:
            return self
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.log_path, "ab", opener=_private) as log:  # 0600: its user's alone
                self.process = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            while time.monotonic() < deadline and self.process.poll() is None:
                if _answers(self.rpc_port) and _answers(self.http_port):
                    return self
                time.sleep(0.05)
            if self.process.poll() is None or time.monotonic() >= deadline:
                self.kill()
                raise RuntimeError(f"mooncake_master did not come up on {self.master} / {self.metadata}:\n{self.log_tail()}")
            time.sleep(0.5)  # it exited (port still held by the last one): try again

    def kill(self) -> None:
        """SIGKILL the master (as a crash would) and reap it."""
        p = self.process
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        p = self.process
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the master's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(line[:400] for line in text.splitlines()[-lines:])

    def cleanup(self) -> None:
        """Kill the master and remove its temp log."""
        self.kill()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> MooncakeMaster:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

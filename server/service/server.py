"""Building and running the daemon's gRPC server.

:func:`create_server` binds every service of :data:`~kvtier.server.service.registry.SERVICES` plus
the standard health and reflection services and returns the server with the address it really
bound (port 0 picks a free port). :func:`serve` runs it until SIGTERM/SIGINT, then stops taking new
calls, lets in-flight calls finish within ``grace_seconds``, runs the state's shutdown hooks and
returns 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier.addresses import default_socket_path, is_loopback, is_unix, resolve_address, socket_path
from kvtier.server.service.config import DaemonConfig
from kvtier.server.service.errors import DomainErrorInterceptor
from kvtier.server.service.registry import SERVICES, ServiceEntry
from kvtier.server.service.state import DaemonState

log = logging.getLogger("kvtier.service")


class AddressError(ValueError):
    """The listen address cannot be used (not loopback without TLS, in use, bad path)."""


def _prepare_unix_socket(path: Path, *, default: bool) -> None:
    if default:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
    elif not path.parent.is_dir():
        raise AddressError(f"directory {path.parent} of unix socket {path} does not exist")
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket of a daemon that is gone
        else:
            raise AddressError(f"{path} is in use by a running daemon")
        finally:
            probe.close()


def _bind(server: grpc.Server, config: DaemonConfig) -> str:
    address = resolve_address(config.listen)
    creds = None
    if config.tls_cert:
        creds = grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])
    if not is_loopback(address) and creds is None:
        raise AddressError(f"refusing to listen on {address} without TLS: use a loopback host, a unix socket, "
                           f"or set tls_cert and tls_key")
    if is_unix(address):
        path = Path(socket_path(address))
        _prepare_unix_socket(path, default=not config.listen or path == default_socket_path())
        old = os.umask(0o177)  # the socket is created 0600
        try:
            port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        finally:
            os.umask(old)
        if not port:
            raise AddressError(f"could not bind {address}")
        os.chmod(path, 0o600)
        return address
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as e:
        raise AddressError(f"could not bind {address}: {e}") from None
    if not port:
        raise AddressError(f"could not bind {address}")
    host = address.rpartition(":")[0]
    return f"{host}:{port}"


def create_server(
    config: DaemonConfig,
    state: DaemonState | None = None,
    *,
    health_servicer: health.HealthServicer | None = None,
    services: list[ServiceEntry] | None = None,
) -> tuple[grpc.Server, str]:
    """Build (not start) the daemon's server and bind its address.

    Args:
        config: listen address, workers, message limits, TLS.
        state: shared state for the servicers (default: a fresh ``DaemonState(config)``).
        health_servicer: the health service to register (pass one to flip it to NOT_SERVING on shutdown).
        services: services to serve (default :data:`SERVICES`).

    Returns:
        ``(server, bound_address)``: ``unix:///path`` or ``HOST:PORT`` with the real port.

    Raises:
        AddressError: the address is not usable.
    """
    state = state if state is not None else DaemonState(config)
    services = SERVICES if services is None else services
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="kvtier-rpc"),
        interceptors=[DomainErrorInterceptor()],
        options=config.grpc_options(),
    )
    for entry in services:
        entry.add_to_server(entry.factory(state), server)
    hs = health_servicer or health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [e.name for e in services]
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    state.tiers.watch_health(lambda tier_service, ok: hs.set(tier_service, serving if ok else not_serving))  # kvtier.tier.<name>
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = _bind(server, config)
    return server, address


def serve(config: DaemonConfig) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit code (0 after a clean stop).

    Creates ``config.pools`` before serving, writes the bound address to ``config.ready_file``
    once serving, and on a signal: health NOT_SERVING, no new calls, in-flight calls get
    ``grace_seconds``, shutdown hooks run, the unix socket and ready file are removed.
    """
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(config.torch_threads)
    state = DaemonState(config)
    state.create_configured_pools()
    hs = health.HealthServicer()
    server, address = create_server(config, state, health_servicer=hs)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s: stopping (grace %.1fs)", signal.Signals(signum).name, config.grace_seconds)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    if config.ready_file:
        tmp = Path(config.ready_file + ".tmp")
        tmp.write_text(address)
        tmp.replace(config.ready_file)
    log.info("kvtier %s serving on %s (device %s, %d pools)", state.version, address, state.device, len(state.pools.list()))
    while not stop.wait(1.0):
        pass
    hs.enter_graceful_shutdown()
    server.stop(config.grace_seconds).wait()
    state.close()
    if is_unix(address):
        with contextlib.suppress(FileNotFoundError):
            Path(socket_path(address)).unlink()
    log.info("stopped")
    return 0

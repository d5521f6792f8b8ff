"""Building and running the daemon's gRPC server.

:func:`create_server` binds every service of :data:`~kvtier.server.service.registry.SERVICES` plus
the standard health and reflection services and returns the server with the address it really
bound (port 0 picks a free port). :func:`serve` runs it until SIGTERM/SIGINT, then stops taking new
calls, lets in-flight calls finish within ``grace_seconds``, runs the daemon's shutdown hooks within
``close_seconds`` and exits -- even if a worker thread is stuck in a call (then it says so).

Where it listens: without ``auth_tokens`` (one tenant) only on a unix socket or a loopback host,
TLS or not; with tokens, any host, but only with TLS (a bearer token never crosses a network in the
clear). ``tls_client_ca`` makes TLS mutual (clients must present a certificate that CA signed).

Calls run on ``config.workers`` threads (``kvtier-rpc``), except the monitoring calls (health
check, ListPools, GetStats, GetTierStats, GetUnitStats), which run on threads of their own
(``kvtier-monitor``, :mod:`~kvtier.server.service.monitoring`) so a data path holding every worker
cannot stop them. A call whose request message has not arrived ``config.request_arrival_seconds``
after it started is cancelled, and calls still waiting for theirs hold a bounded share of each pool
(:mod:`~kvtier.server.service.arrival`). Health ``Watch`` and reflection streams hold a few slots
of their own (:mod:`~kvtier.server.service.open_streams`).

Besides the daemon's services it serves one health service per tier (``kvtier.tier.<name>``, kept in
step by the tier monitor thread, which :func:`serve` starts once serving) and, with
``metrics_port``, Prometheus metrics and the RPC latency histogram (``observability``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import ssl
import stat
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier.addresses import (
    SocketPathInUseError, UnsafePathError, UnsafeSocketDirError, UnsafeSocketError, check_path_owners, check_socket_path,
    clear_stale_socket, default_socket_path, is_loopback, is_unix, prepare_private_dir, resolve_address, socket_path,
)
from kvtier.server.daemon.config import DaemonConfig
from kvtier.server.daemon.core import Daemon
from kvtier.server.daemon.private_files import AuthConfigError, read_tls_files
from kvtier.server.daemon.tier_runtime import check_disk_path_free
from kvtier.server.daemon.tier_settings import TierSettings
from kvtier.private_writes import OutputPathError, check_output_path, write_private_file
from kvtier.server.observe.logs import configure_logging
from kvtier.server.hostmem.malloc import keep_freed_memory
from kvtier.server.tiers.disk_faults import fault_hooks_in_env
from kvtier.attach_wire import attach_socket_path
from kvtier.server.service.arrival import RequestArrival, waiting_cap
from kvtier.server.service.attach_channel import AttachChannel
from kvtier.server.service.connections import connection_options, raise_fd_limit
from kvtier.server.service.auth import AuthInterceptor
from kvtier.server.service.errors import DomainErrorInterceptor
from kvtier.server.service.interceptors import CallTracker
from kvtier.server.service.monitoring import MONITOR_POOL, WORKER_POOL, MonitoringDispatch, pool_of
from kvtier.server.service.observability import build_metrics
from kvtier.server.service.open_streams import OpenStreams, open_stream_guard
from kvtier.server.service.registry import SERVICES, ServiceEntry
from kvtier.server.service.streams import StreamGuard
from kvtier.server.transfer.engine import check_engine_available

log = logging.getLogger("kvtier.service")

STOP_SLACK_SECONDS = 5.0  # after the grace period: time for cancelled calls to leave their workers
STREAMS_SETTLE_SECONDS = 1.0  # after the stream watchdog cancels the KV streams left: time for them to end


class AddressError(ValueError):
    """The listen address cannot be used (not loopback without TLS and tokens, in use, bad path)."""


class ReadyFileError(ValueError):
    """The ``--ready-file`` cannot be written (a missing or unwritable directory, a directory at the path);
    the message is one line."""


@dataclass
class DaemonServer:
    """A built (not started) server and what its shutdown needs.

    Attributes:
        server: the gRPC server. address: the bound address (``unix:///path`` or ``HOST:PORT``).
        state: the daemon domain. calls: calls in flight. streams: the stream guard.
    """

    server: grpc.Server
    address: str
    state: Daemon
    calls: CallTracker
    streams: StreamGuard

    def __iter__(self):  # ``server, address = create_server(...)`` keeps working
        return iter((self.server, self.address))


def _prepare_unix_socket(path: Path, *, default: bool) -> None:
    if default:
        try:
            prepare_private_dir(path.parent)  # ours, not a symlink, 0700; another user's directory is refused
        except (UnsafeSocketDirError, OSError) as e:
            raise AddressError(str(e)) from None
    elif not path.parent.is_dir():
        raise AddressError(f"directory {path.parent} of unix socket {path} does not exist")
    try:
        # every directory on the way ours or root's, not group/other-writable unless sticky (/tmp); an existing
        # socket ours: clients check the same before they send a token
        check_socket_path(path)
        # only a stale socket of ours is replaced, at the gRPC path and at the attach path beside it; a file,
        # a directory, another uid's entry or a live socket of either type is refused in one line
        clear_stale_socket(path, socket.SOCK_STREAM)
        clear_stale_socket(attach_socket_path(str(path)), socket.SOCK_SEQPACKET)
    except (UnsafeSocketError, SocketPathInUseError) as e:
        raise AddressError(str(e)) from None


def _credentials(config: DaemonConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    files = read_tls_files(config)  # checked: owner, mode, the way to them
    pair = [(files["tls_key"], files["tls_cert"])]
    if config.tls_client_ca:
        return grpc.ssl_server_credentials(pair, root_certificates=files["tls_client_ca"],
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def _why(e: BaseException, what: str) -> str:
    """An OSError's reason, or what an SSLError means for ``what`` was loaded."""
    if isinstance(e, ssl.SSLError):
        return f"OpenSSL refused them: {what}"
    return str(getattr(e, "strerror", None) or e)


def check_tls_files(config: DaemonConfig) -> None:
    """Load ``--tls-cert``/``--tls-key`` (and ``--tls-client-ca``, ``--peer-tls-ca``) as the daemon will, before anything
    is allocated: a file that is not PEM, or a key that does not match its certificate, is one line
    (attack pass 4, A4-4: gRPC failed the bind, and the traceback blamed the address).

    Raises:
        AddressError: naming the file and what is wrong.
    """
    try:  # who may write them decides who may call (a client CA) or whom the daemon trusts (A5-2)
        read_tls_files(config)
    except AuthConfigError as e:
        raise AddressError(str(e)) from None
    if config.peer_tls_ca:  # the CA PullKV checks peers against: loaded now, not at the first pull
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=config.peer_tls_ca)
        except (OSError, ssl.SSLError) as e:
            raise AddressError(f"--peer-tls-ca {config.peer_tls_ca} cannot be loaded ({_why(e, 'not PEM CA certificates')}): "
                               f"give the PEM certificate of the peers' certificate authority") from None
    if not config.tls_cert:
        return
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise AddressError(f"--tls-cert {config.tls_cert} and --tls-key {config.tls_key} cannot be loaded "
                           f"({_why(e, 'not PEM, or a key that does not match the certificate')}): give a PEM certificate and "
                           f"its PEM private key") from None
    if config.tls_client_ca:
        try:
            ctx.load_verify_locations(cafile=config.tls_client_ca)
        except (OSError, ssl.SSLError) as e:
            raise AddressError(f"--tls-client-ca {config.tls_client_ca} cannot be loaded "
                               f"({_why(e, 'not PEM CA certificates')}): give PEM "
                               f"CA certificates") from None


def check_listen_address(config: DaemonConfig) -> str:
    """The resolved listen address, checked (loopback TCP with TLS and tokens or mutual TLS, or
    plaintext and tokenless with ``allow_unauthenticated``; beyond loopback with TLS and tokens; a
    unix socket's directory private and no daemon on it) and its socket directory prepared. ``serve`` runs it before
    allocating anything.

    Raises:
        AddressError: the address cannot be used.
    """
    try:
        address = resolve_address(config.listen)
    except ValueError as e:
        raise AddressError(str(e)) from None
    check_tls_files(config)
    if not is_loopback(address):
        if not config.tls_cert:
            raise AddressError(f"refusing to listen on {address} without TLS: use a loopback host, a unix socket, "
                               f"or give --tls-cert and --tls-key (TOML tls_cert, tls_key) and --auth-tokens")
        if not config.auth_tokens:
            raise AddressError(f"refusing to listen on {address} without --auth-tokens: with one tenant any client "
                               f"that reaches it could use every pool; use a loopback host or a unix socket, or give "
                               f"--auth-tokens FILE")
    elif not is_unix(address) and not config.tls_cert:
        if config.auth_tokens:  # attack pass 6, A6-1
            raise AddressError(f"refusing to listen on {address} with --auth-tokens but without TLS: a loopback port has "
                               f"no owner, so another local user could take it while the daemon is down and receive "
                               f"the clients' tokens (clients refuse to send them there); use a unix socket, or give "
                               f"--tls-cert and --tls-key")
        if not config.allow_unauthenticated:
            raise AddressError(f"refusing to listen on {address} without TLS: any local user, whatever its uid, could "
                               f"read, overwrite and free every pool's KV through a TCP port, or take the port while "
                               f"the daemon is down and answer its clients; use a unix socket (private to this user), "
                               f"give --tls-cert and --tls-key with --auth-tokens or --tls-client-ca, or pass "
                               f"--allow-unauthenticated to accept that")
    elif not is_unix(address) and not (config.auth_tokens or config.tls_client_ca or config.allow_unauthenticated):
        raise AddressError(f"refusing to listen on {address} over TLS without --auth-tokens or --tls-client-ca: any "
                           f"local user could read, overwrite and free every pool's KV; give one, or pass "
                           f"--allow-unauthenticated to accept that")
    if is_unix(address):
        path = Path(socket_path(address))
        _prepare_unix_socket(path, default=not config.listen or path == default_socket_path())
        tiers = TierSettings.coerce(getattr(config, "tiers", None))
        if "disk" in tiers.tier_names:  # before the disk tier makes its directory there (attack pass 7: it did,
            # then the socket's check refused the directory it had just made and told the user to remove it)
            disk = os.path.realpath(Path(tiers.disk_path).expanduser().absolute())
            for sock in (path, Path(attach_socket_path(str(path)))):
                if disk == os.path.realpath(sock.absolute()):
                    raise AddressError(f"--disk-path {tiers.disk_path} is the daemon's socket path {sock}; give the "
                                       f"disk tier a directory of its own")
    else:
        _check_port_free(address)
    return address


def _check_port_free(address: str) -> None:
    """Raise AddressError when another process listens on TCP ``address`` (HOST:PORT; port 0 is
    always free): a plain test bind, so the refusal comes before the daemon allocates anything.
    The server's own bind (without SO_REUSEPORT) refuses it too, should the port be taken in between."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except OSError:
        return  # left to the server's bind, which names the address
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a port in TIME_WAIT is free
            try:
                probe.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise AddressError(_IN_USE.format(address=address)) from None
                return


_IN_USE = ("could not listen on {address}: the port is in use (another kvtier daemon?); stop that process or give "
           "another --listen")


def _bind(server: grpc.Server, config: DaemonConfig) -> str:
    address = check_listen_address(config)
    creds = _credentials(config)
    if is_unix(address):
        path = Path(socket_path(address))
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
    except RuntimeError:
        port = 0
    if not port:
        raise AddressError(f"could not listen on {address}: the port is in use (another kvtier daemon?) or the address "
                           f"is not this machine's; stop that process or give another --listen")
    host = address.rpartition(":")[0]
    return f"{host}:{port}"


def _serve_tier_health(hs: health.HealthServicer, state: Daemon) -> None:
    """One health service per tier (``kvtier.tier.host``, ``kvtier.tier.disk``, ``kvtier.tier.mooncake``), kept in step with the
    tier's health by the tier monitor (called from its thread, no lock of the daemon held)."""
    def status(healthy: bool) -> int:
        return health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING

    for t in state.tiers.stack.tiers:
        hs.set(t.health.service_name, status(t.health.healthy))
    state.tiers.monitor.add_listener(lambda snap: hs.set(snap.service_name, status(snap.healthy)))


def create_server(
    config: DaemonConfig,
    state: Daemon | None = None,
    *,
    health_servicer: health.HealthServicer | None = None,
    services: list[ServiceEntry] | None = None,
) -> DaemonServer:
    """Build (not start) the daemon's server and bind its address.

    Args:
        config: listen address, workers, stream limits, message limits, TLS, tokens.
        state: the daemon domain for the servicers (default: a fresh ``Daemon(config)``).
        health_servicer: the health service to register (pass one to flip it to NOT_SERVING on shutdown).
        services: services to serve (default :data:`SERVICES`).

    Returns:
        A :class:`DaemonServer` (unpacks as ``(server, bound_address)``: ``unix:///path`` or
        ``HOST:PORT`` with the real port).

    Raises:
        AddressError: the address is not usable.
    """
    state = state if state is not None else Daemon(config)
    services = SERVICES if services is None else services
    state.metrics = build_metrics(config, state)  # None unless metrics_port is set; served by serve()
    calls = CallTracker()
    tenants = len(state.tokens.tenants) if state.tokens else 1
    streams = StreamGuard(config.stream_slots, config.stream_idle_seconds,
                          tenant_slots=config.tenant_stream_slots(tenants))  # a share each when tenants share it
    open_streams = open_stream_guard(config.workers, config.stream_idle_seconds)  # health Watch, reflection
    state.add_shutdown_hook(open_streams.close)
    rpc_timer = state.metrics.interceptor if state.metrics else None
    # the RPC timer sits inside auth, so it sees the authenticated caller's tenant; auth times its own
    # refusals through it (UNAUTHENTICATED, no tenant)
    # outermost: monitoring calls (health check, stats, pool list) run on threads the data path never
    # takes (monitoring.py); every other call on the --workers threads
    monitoring = MonitoringDispatch()
    state.add_shutdown_hook(monitoring.close)
    # next: a call whose request message does not arrive in time is cancelled, and late ones hold a
    # bounded share of each pool (arrival.py); it reads the message before any other interceptor runs
    arrival = RequestArrival(config.request_arrival_seconds,
                             {MONITOR_POOL: waiting_cap(monitoring.workers), WORKER_POOL: waiting_cap(config.workers)},
                             pool_of, small_pools=frozenset({MONITOR_POOL}))
    state.add_shutdown_hook(arrival.close)
    interceptors = [monitoring, arrival, calls, AuthInterceptor(state.tokens, timer=rpc_timer, sessions=state.sessions),
                    *([rpc_timer] if rpc_timer else []),
                    # innermost: health Watch and reflection streams hold slots of their own (open_streams.py);
                    # its refusal is a domain error, mapped by the interceptor around it
                    DomainErrorInterceptor(), OpenStreams(open_streams)]
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix=WORKER_POOL),
        interceptors=interceptors,
        # gRPC sets SO_REUSEPORT by default: a second daemon on the same TCP port would start and the
        # kernel would share connections between the two. One daemon a port: the second one's bind fails.
        # and a connection that sends nothing is closed, at most half the fds are connections (connections.py)
        options=[*config.grpc_options(), ("grpc.so_reuseport", 0), *connection_options(config)],
    )
    for entry in services:
        entry.add_to_server(entry.factory(state, streams), server)
    hs = health_servicer or health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [e.name for e in services]
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    _serve_tier_health(hs, state)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        address = _bind(server, config)
    except BaseException:
        streams.close()
        raise
    state.transfer.own_addresses.add(address)  # a PullKV naming this address copies in process
    return DaemonServer(server, address, state, calls, streams)


def _run_bounded(fn, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    """Run ``fn`` in a daemon thread; True if it finished within ``seconds``."""
    t = threading.Thread(target=fn, name="kvtier-close", daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def _exit_now(code: int) -> None:
    """Leave the process at once: worker threads stuck in a call would block the interpreter's exit
    (it joins the executor's threads) forever."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _own_files(config: DaemonConfig | None) -> list[tuple[str, str]]:
    """(what, path) of the files the daemon itself serves from or reads, none of which its ready file
    may be: its sockets, its token, TLS and metrics-token files, start pools' config.json files."""
    if config is None:
        return []
    out: list[tuple[str, str]] = []
    try:
        address = resolve_address(config.listen)
    except ValueError:
        address = ""
    if is_unix(address):
        out += [("the daemon's own --listen socket", socket_path(address)),
                ("the daemon's own attach socket", socket_path(address) + ".attach")]
    for flag, value in (("--auth-tokens", config.auth_tokens), ("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key),
                        ("--tls-client-ca", config.tls_client_ca), ("--peer-tls-ca", config.peer_tls_ca),
                        ("--metrics-token-file", config.metrics_token_file)):
        if value:
            out.append((f"the {flag} file", value))
    out += [("a [[pools]] model file", spec.model) for spec in config.pools if os.path.isfile(spec.model)]
    return out


def _same_file(a: str | Path, b: str | Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # a hard link
    except OSError:
        return False


def check_ready_file(path: str | Path, config: DaemonConfig | None = None) -> None:
    """Raise :class:`ReadyFileError` unless the daemon can write its ready file at ``path``: its directory
    exists and takes a new file (a temporary one is made and removed), ``path`` is not a directory, and a
    file already there can be replaced (not another user's in a sticky directory such as ``/tmp``), and
    no other user controls a directory on the way (:func:`kvtier.addresses.check_path_owners`).
    ``serve`` runs it before allocating anything; the ready file is written only once serving."""
    p = Path(path)
    parent = p.parent
    if not parent.is_dir():
        raise ReadyFileError(f"--ready-file {p}: its directory {parent} does not exist; create it or give another path")
    try:  # the socket paths' check (attack pass 4, A4-10): the owner of a directory on the way could
        # replace the file with an address of its own, and a launcher would send its token there
        check_path_owners(p, "--ready-file", "file", UnsafePathError, entry_owner=False)
    except UnsafePathError as e:
        raise ReadyFileError(str(e)) from None
    if p.is_dir() and not p.is_symlink():
        raise ReadyFileError(f"--ready-file {p} is a directory; give the path of a file")
    try:  # a device node (/dev/null), a FIFO, a socket or a symlink there was replaced (attack pass 7, A7-6)
        check_output_path(p, "--ready-file")
    except OutputPathError as e:
        raise ReadyFileError(str(e)) from None
    for what, own in _own_files(config):  # regular files too: the ready file replaced them (A7-6)
        if _same_file(p, own):
            raise ReadyFileError(f"--ready-file {p} is {what}, which the ready file would replace; give another path")
    disk = config.tiers.disk_path if config is not None and hasattr(config.tiers, "disk_path") else ""
    if disk and os.path.realpath(p.parent) == os.path.realpath(disk):
        raise ReadyFileError(f"--ready-file {p} is in the disk tier's directory {disk} (--disk-path), whose files "
                             f"the daemon owns; give a path elsewhere")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{p.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ReadyFileError(f"--ready-file {p}: cannot write in {parent} ({e.strerror or e}); give a path in a "
                             f"directory this user may write") from None
    if os.path.lexists(p) and os.geteuid() != 0:
        owner, d = os.lstat(p).st_uid, os.stat(parent)
        if d.st_mode & stat.S_ISVTX and os.geteuid() not in (owner, d.st_uid):
            raise ReadyFileError(f"--ready-file {p} belongs to uid {owner} in the sticky directory {parent}, so this "
                                 f"user cannot replace it; remove it or give another path")


def _stop_started(built: DaemonServer, attach: AttachChannel | None) -> None:
    """Undo a start that cannot go on (the metrics port taken, the ready file unwritable): stop serving
    at once, end the attach channel, close the daemon and remove the gRPC socket."""
    built.server.stop(0)
    if attach is not None:
        attach.stop()  # removes the attach socket
    built.streams.close()
    if built.state.metrics is not None:
        built.state.metrics.stop()
    built.state.close()
    if is_unix(built.address):
        with contextlib.suppress(FileNotFoundError):
            Path(socket_path(built.address)).unlink()


def serve(config: DaemonConfig) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit code (0 after a clean stop).

    Creates ``config.pools`` before serving, writes the bound address to ``config.ready_file``
    once serving (mode 0600: :func:`~kvtier.private_writes.write_private_file`), and on a signal:
    health NOT_SERVING, no new calls, in-flight calls get ``grace_seconds`` (then they are
    cancelled), the shutdown hooks get ``close_seconds``, the unix sockets are removed (the ready file
    stays). Never waits forever: with a call still stuck in a worker after all that, it logs it and
    exits at once (0 if the shutdown hooks finished, else 1). A shutdown hook that raised makes the exit 1.

    Raises:
        AddressError, ReadyFileError, ValueError, KVTierError: the daemon cannot start (one line); a
            failure after serving began (the metrics port taken, the ready file unwritable after all)
            first stops what was started and removes the sockets.
    """
    configure_logging(config.log_level, config.log_format)
    raise_fd_limit()  # before the server reads the limit for its connection cap (connections.py)
    for name in fault_hooks_in_env():  # tests only: never on by accident without a line saying so
        log.warning("%s is set: a test-only fault hook of the disk tier is on; unset it outside tests", name)
    config.check_metrics_auth()  # before anything is allocated: metrics nobody decided how to guard
    check_listen_address(config)  # before any pool or tier is allocated: a bad address is one line
    check_disk_path_free(config)  # likewise a --disk-path another daemon holds (the disk tier's lock decides)
    if config.ready_file:
        check_ready_file(config.ready_file, config)  # and a ready file that could not be written once serving
    if config.transfer_engine == "mooncake":
        check_engine_available()  # likewise a missing library
    import torch

    from kvtier.server.pool.device_copy import set_copy_threads

    torch.set_num_threads(config.torch_threads)
    set_copy_threads(config.copy_threads or min(os.cpu_count() or 1, 64))
    keep_freed_memory()  # gRPC's message buffers and LMDB's transaction pages are reused, not faulted in per call
    state = Daemon(config)
    state.create_configured_pools()
    hs = health.HealthServicer()
    built = create_server(config, state, health_servicer=hs)
    server, address = built.server, built.address
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s: stopping (grace %.1fs)", signal.Signals(signum).name, config.grace_seconds)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    attach = None
    if is_unix(address):  # local attach: a side socket beside the gRPC one (a TCP daemon has none)
        try:
            attach = AttachChannel(state, attach_socket_path(socket_path(address)))
        except (OSError, ValueError) as e:  # ValueError: SocketPathInUseError, something new at the path
            built.streams.close()
            state.close()
            raise AddressError(f"could not listen for local attach beside {address}: {e}") from None
    server.start()
    if attach is not None:
        attach.start()
    state.tiers.start_monitor()
    if not is_unix(address) and not (config.auth_tokens or config.tls_client_ca):
        log.warning("serving %s without --auth-tokens (--allow-unauthenticated): any local user, whatever its uid, "
                    "may read, overwrite and free every pool's KV", address)
    if state.metrics is not None:
        try:
            state.metrics_address = state.metrics.start()
        except OSError as e:
            _stop_started(built, attach)
            raise AddressError(f"could not serve metrics on {config.metrics_host}:{config.metrics_port}: {e}") from None
        if config.metrics_insecure:
            log.warning("metrics are served on %s without a token (--metrics-insecure): whoever reaches the port "
                        "reads tenant names, pool ids and per-tenant call counts", state.metrics_address)
        if not is_loopback(f"{config.metrics_host}:0"):
            log.warning("metrics are served beyond loopback (%s): they name pools and tiers", state.metrics_address)
    if config.ready_file:
        try:
            write_private_file(config.ready_file, address, "--ready-file")
        except OSError as e:  # checked at start; changed since (removed, filled up, made read-only)
            _stop_started(built, attach)
            raise ReadyFileError(f"could not write --ready-file {config.ready_file} ({e.strerror or e}); "
                                 f"stopped") from None
    n_tenants = len(state.tokens.tenants) if state.tokens else 1
    n_pools = len(state.pools.list())
    mode = f"{n_tenants} tenant{'' if n_tenants == 1 else 's'}" + ("" if state.tokens else ", no --auth-tokens")
    log.info("kvtier %s serving on %s (device %s, %d pool%s, %s)", state.version, address, state.device,
             n_pools, "" if n_pools == 1 else "s", mode)
    while not stop.wait(1.0):
        pass
    hs.enter_graceful_shutdown()
    stop_began = time.monotonic()
    stopped = server.stop(config.grace_seconds)
    stopped.wait(config.grace_seconds + STOP_SLACK_SECONDS)
    if attach is not None:
        attach.stop()  # sessions end: their slots are freed and leases released before the tiers close
    built.streams.close()
    if state.metrics is not None:
        state.metrics.stop()
    settle = time.monotonic() + STREAMS_SETTLE_SECONDS  # streams just cancelled end on their own threads
    while built.calls.in_flight and time.monotonic() < settle:
        time.sleep(0.02)
    stuck = built.calls.in_flight
    if stuck:
        log.error("%d calls are still running in worker threads %.1f s after the shutdown began (grace period "
                  "%.1f s); closing without them", stuck, time.monotonic() - stop_began, config.grace_seconds)
    closed = _run_bounded(state.close, config.close_seconds)
    if not closed:
        log.error("the shutdown work (moving records down to disk, closing tiers) did not finish in %.0f s "
                  "(close_seconds); exiting anyway", config.close_seconds)
    failed = state.failed_shutdown_hooks
    if failed:
        log.error("%d part%s of the shutdown work failed (logged above); exiting 1", failed, "" if failed == 1 else "s")
    if is_unix(address):
        with contextlib.suppress(FileNotFoundError):
            Path(socket_path(address)).unlink()
    log.info("stopped")
    if stuck or not closed:
        _exit_now(0 if closed and not failed else 1)
    return 1 if failed else 0

"""The client's base: one channel, lazily created stubs per service, deadlines and safe retries.

Feature mixins (``client/pool.py``, and e.g. ``client/tiers.py``, ``client/transfer.py``) build on
:class:`BaseClient` only through :meth:`BaseClient.stub`, :meth:`BaseClient.unary` and
:meth:`BaseClient.server_stream`; :class:`kvtier.client.KVTierClient` lists the mixins.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.addresses import UnsafeSocketError, check_socket_path, is_unix, resolve_address, socket_path
from kvtier.bearer import check_token
from kvtier.client.errors import DeadlineExceededError, FailedPreconditionError, KVTierError, from_rpc_error

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4096  # the daemon refuses smaller KV pieces (but a segment's last)
CHUNK_OVERHEAD_BYTES = 1024  # room a KV chunk message needs beside its data
TOKEN_ENV = "KVTIER_TOKEN"
# TLS settings a client takes from the environment when its arguments leave them out (the CLI's
# commands reach a TLS daemon this way): argument name -> variable.
TLS_ENV = {"tls_root_cert": "KVTIER_TLS_CA", "tls_server_name": "KVTIER_TLS_SERVER_NAME",
           "tls_client_cert": "KVTIER_TLS_CERT", "tls_client_key": "KVTIER_TLS_KEY"}
T = TypeVar("T")
log = logging.getLogger("kvtier.client")
BUSY_MAX_PAUSE_S = 0.2
MAX_TIMEOUT_S = 86400.0
"""Longest deadline a client takes for its calls (a day); a larger, infinite or NaN one is refused."""
"""Longest pause between attempts of a call the daemon answered "changed nothing" (it retries until its deadline)."""


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _CallMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata entries to every call of a channel: ``authorization: Bearer <token>``, an
    attach session's ``x-kvtier-session`` (both secrets: never printed)."""

    def __init__(self, entries: list[tuple[str, str]]) -> None:
        self._entries = list(entries)

    def __repr__(self) -> str:
        return f"_CallMetadata({[k for k, _ in self._entries]}, values hidden)"

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(d.metadata or ()), *self._entries]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)


class _NoSocket(grpc.RpcError):
    """UNAVAILABLE for a call not sent: no socket at the address (what gRPC's failed connect would say)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._details = f"failed to connect to all addresses; last error: UNKNOWN: unix:{path}: No such file or directory"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()


class _SocketCheck(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Before every call on a unix socket: :func:`kvtier.addresses.check_socket_path` (the way to the
    socket only root's or this uid's, the socket too; no directory others may write, sticky or not),
    so a token never goes to a socket another local user put there. A refusal is a
    FailedPreconditionError naming the path and the reason; a missing socket is UNAVAILABLE without
    dialing (gRPC would wait for one to appear, whoever makes it)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def _check(self) -> None:
        try:
            exists = check_socket_path(self._path)
        except UnsafeSocketError as e:
            raise FailedPreconditionError(str(e)) from None
        if not exists:
            raise _NoSocket(self._path)

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        self._check()
        return continuation(client_call_details, request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        self._check()
        return continuation(client_call_details, request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        self._check()
        return continuation(client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        self._check()
        return continuation(client_call_details, request_iterator)



#: The largest certificate or key file a client reads (a chain of a few certificates is kilobytes).
MAX_PEM_BYTES = 1 << 20


def read_pem_file(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of a TLS certificate or key file: a regular file of at most :data:`MAX_PEM_BYTES`,
    opened without blocking (``/dev/zero`` was read until the client had taken 4 GB; a FIFO would
    hang; attack pass 9, A9-9).

    Raises:
        ValueError: one line naming ``what`` and the path (missing, not a regular file, too large).
    """
    import stat as _stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot open it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not _stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path}: not a regular file")
        if st.st_size > MAX_PEM_BYTES:
            raise ValueError(f"{what} {path}: {st.st_size} bytes, more than a certificate or key file holds "
                             f"({MAX_PEM_BYTES})")
        return f.read(MAX_PEM_BYTES + 1)[:MAX_PEM_BYTES]


class BaseClient:
    """A connection to a kvtier daemon.

    Args:
        address: ``unix:///path`` or ``HOST:PORT``; None: the daemon's default unix socket.
        timeout: deadline in seconds of every call (a call may pass its own); retries share it.
        max_message_bytes: largest gRPC message either way; use the daemon's value (default 4 MiB).
        chunk_bytes: data bytes per streamed KV chunk (at most ``max_message_bytes - 1024``).
        retries: extra attempts for idempotent calls that fail with UNAVAILABLE; an UNAVAILABLE the
            daemon marks "changed nothing" (slots a write still arriving is writing) is retried until
            the call's deadline, any call. 0: no retries at all.
        token: bearer token of a daemon with tenants (``--auth-tokens``); None: ``$KVTIER_TOKEN`` if
            set. Sent as ``authorization: Bearer <token>`` on every call; never printed.
        tls_root_cert: PEM file of the daemon's certificate authority: connect with TLS. None:
            ``$KVTIER_TLS_CA`` if set.
        tls_server_name: name to check the daemon's certificate against (default: the host;
            ``$KVTIER_TLS_SERVER_NAME`` if set).
        tls_client_cert, tls_client_key: PEM client certificate and key for a daemon that requires
            mutual TLS (``--tls-client-ca``); None: ``$KVTIER_TLS_CERT`` / ``$KVTIER_TLS_KEY`` if set.
        metadata: more ``(key, value)`` metadata on every call (an attached pool's client carries its
            session this way; values are never printed).

    Raises:
        ValueError: bad address or sizes, a token that is not visible ASCII (:func:`check_token`),
            or a token for a TCP address without TLS, loopback included (a port has no owner: another
            local user can take it while the daemon is down, or take over gRPC's reconnect, and
            receive the token; attack pass 6, A6-1). Use the unix socket, or TLS.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        retries: int = 3,
        token: str | None = None,
        tls_root_cert: str | Path | None = None,
        tls_server_name: str | None = None,
        tls_client_cert: str | Path | None = None,
        tls_client_key: str | Path | None = None,
        metadata: list[tuple[str, str]] | tuple[tuple[str, str], ...] = (),
    ) -> None:
        if not 0 < timeout <= MAX_TIMEOUT_S:  # NaN too: every call would fail at once (attack pass 4, A4-13)
            raise ValueError(f"timeout must be > 0 and at most {MAX_TIMEOUT_S:g} seconds (a day), got {timeout}")
        if not 64 * 1024 <= max_message_bytes <= (1 << 31) - 1:  # gRPC's C int (attack pass 5, A5-4)
            raise ValueError(f"max_message_bytes must be 65536..2147483647 (gRPC's limit), got {max_message_bytes}")
        if not MIN_CHUNK_BYTES <= chunk_bytes <= max_message_bytes - CHUNK_OVERHEAD_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, max_message_bytes - {CHUNK_OVERHEAD_BYTES}], "
                             f"got {chunk_bytes}")
        env = {arg: os.environ.get(var) or None for arg, var in TLS_ENV.items()}
        tls_root_cert = tls_root_cert if tls_root_cert is not None else env["tls_root_cert"]
        tls_server_name = tls_server_name if tls_server_name is not None else env["tls_server_name"]
        tls_client_cert = tls_client_cert if tls_client_cert is not None else env["tls_client_cert"]
        tls_client_key = tls_client_key if tls_client_key is not None else env["tls_client_key"]
        if bool(tls_client_cert) != bool(tls_client_key):
            raise ValueError("tls_client_cert and tls_client_key go together")
        self.address = resolve_address(address)
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = chunk_bytes
        self.retries = retries
        self._closed = False
        options: list[tuple[str, Any]] = [("grpc.max_send_message_length", max_message_bytes),
                                          ("grpc.max_receive_message_length", max_message_bytes)]
        source = "token" if token is not None else f"${TOKEN_ENV}"
        token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        if token:
            check_token(token, source)
        self._token = token
        self._tls = {"tls_root_cert": tls_root_cert, "tls_server_name": tls_server_name,
                     "tls_client_cert": tls_client_cert, "tls_client_key": tls_client_key}
        tls = tls_root_cert is not None or tls_client_cert is not None
        if token and not tls and not is_unix(self.address):
            raise ValueError(f"refusing to send a token to {self.address} in plaintext: another local user could take "
                             f"a TCP port, loopback included, and receive it; use the daemon's unix socket, or TLS "
                             f"(tls_root_cert, $KVTIER_TLS_CA)")
        if tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=read_pem_file(tls_root_cert, "tls_root_cert") if tls_root_cert else None,
                private_key=read_pem_file(tls_client_key, "tls_client_key") if tls_client_key else None,
                certificate_chain=read_pem_file(tls_client_cert, "tls_client_cert") if tls_client_cert else None)
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._raw_channel = grpc.secure_channel(self.address, creds, options=options)
        else:
            self._raw_channel = grpc.insecure_channel(self.address, options=options)
        entries = ([("authorization", f"Bearer {token}")] if token else []) + [(k, v) for k, v in metadata]
        interceptors: list[Any] = [_SocketCheck(socket_path(self.address))] if is_unix(self.address) else []
        if entries:
            interceptors.append(_CallMetadata(entries))
        self._channel = grpc.intercept_channel(self._raw_channel, *interceptors) if interceptors else self._raw_channel
        self._stubs: dict[type, Any] = {}
        #: this client's writer id for unit puts (``put_units``): a unit's two parts pair only when one
        #: writer sent both, so two clients writing the same keys never get their parts joined
        self.writer_id = uuid.uuid4().bytes

    # ----- plumbing for mixins ------------------------------------------------------------------
    def stub(self, stub_cls: type[T]) -> T:
        """The stub of a generated service class on this client's channel (created once)."""
        stub = self._stubs.get(stub_cls)
        if stub is None:
            stub = self._stubs[stub_cls] = stub_cls(self._channel)
        return stub

    def _run(self, fn: Callable[[float], T], idempotent: bool, timeout: float | None) -> T:
        """``fn(time left)`` until it succeeds, within one deadline for every attempt.

        A refusal the daemon marks "changed nothing" (``unchanged``, whatever its code: UNAVAILABLE
        for slots a write still arriving is writing, RESOURCE_EXHAUSTED for every ``--max-streams``
        slot taken) is sent again, writes too, until the deadline, pausing 0.05 s then doubling to at
        most :data:`BUSY_MAX_PAUSE_S` (the claim or the slot lasts as long as another stream); any
        other UNAVAILABLE only for an idempotent call, at most :attr:`retries` times (0.05, 0.1,
        0.2 s ...); a CANCELLED this client did not ask for (it never cancels a call it waits on, but
        :meth:`close` does) likewise: the daemon cancels a call whose request message reached it too
        late, before reading it (``server/service/arrival.py``). Any other error is not retried.
        ``retries=0`` turns both off.

        Raises:
            KVTierError: the last answer's subclass; DeadlineExceededError when the deadline passes
                between attempts or during a retry (naming the last answer before it).
        """
        if timeout is not None and not timeout <= MAX_TIMEOUT_S:  # NaN, inf, 1e308 (attack pass 5, A5-4)
            raise ValueError(f"timeout must be at most {MAX_TIMEOUT_S:g} seconds (a day), got {timeout}")
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        plain = busy = 0
        last: KVTierError | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError("deadline passed before the call could be sent" if last is None else
                                            f"deadline passed while retrying; the last answer was {last}")
            try:
                return fn(left)
            except grpc.RpcError as e:
                err = self._no_daemon_hint(from_rpc_error(e))
                if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and last is not None:
                    # the deadline passed during a retry: the answer worth naming is the one retried
                    raise DeadlineExceededError(f"deadline passed while retrying; the last answer was {last}") from None
                last = err
            if not self.retries:
                raise last from None
            if last.unchanged:  # whatever its code (UNAVAILABLE busy, RESOURCE_EXHAUSTED --max-streams)
                busy += 1
                pause = min(0.05 * 2 ** (busy - 1), BUSY_MAX_PAUSE_S)
            elif idempotent and plain < self.retries and (last.code == grpc.StatusCode.UNAVAILABLE or
                                                          last.code == grpc.StatusCode.CANCELLED and not self._closed):
                plain += 1
                pause = 0.05 * 2 ** (plain - 1)
            else:
                raise last from None
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))

    def _no_daemon_hint(self, err: KVTierError) -> KVTierError:
        """An UNAVAILABLE that is a failed connect says so first, with what to do (gRPC's own
        "failed to connect to all addresses; last error: ..." kept after it)."""
        # a refusal marked "changed nothing" came from the daemon (e.g. naming a PullKV peer it cannot reach)
        if err.code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in err.details and not err.unchanged:
            return type(err)(f"no kvtier daemon answers at {self.address} (start one with `kvtier serve`, or pass "
                             f"its address to KVTierClient); gRPC: {err.details}", err.code)
        return err

    def unary(self, rpc: Callable[..., T], request: Any, *, idempotent: bool, timeout: float | None = None) -> T:
        """Call a unary RPC with a deadline; UNAVAILABLE is retried when ``idempotent``, any refusal
        when the daemon changed nothing (:meth:`_run`). Raises a :class:`~kvtier.client.errors.KVTierError`
        subclass on failure."""
        return self._run(lambda left: rpc(request, timeout=left), idempotent, timeout)

    def client_stream(self, rpc: Callable[..., T], requests: Callable[[], Iterator[Any]], *,
                      timeout: float | None = None) -> T:
        """Call a client-streaming RPC (a write: never idempotent) with a deadline; ``requests()``
        makes the stream afresh for each attempt, so an answer that changed nothing is sent again
        whole (:meth:`_run`). Raises a :class:`~kvtier.client.errors.KVTierError` subclass on failure."""
        return self._run(lambda left: rpc(requests(), timeout=left), False, timeout)

    def server_stream(self, rpc: Callable[..., Iterator[Any]], request: Any, consume: Callable[[Iterator[Any]], T], *,
                      idempotent: bool, timeout: float | None = None) -> T:
        """Call a server-streaming RPC and hand its messages to ``consume`` (which must start from
        scratch on each attempt); the whole stream shares one deadline."""
        return self._run(lambda left: consume(rpc(request, timeout=left)), idempotent, timeout)

    # ----- health and lifetime ------------------------------------------------------------------
    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The health status of ``service`` ("" = the daemon): ``SERVING``, ``NOT_SERVING``, ..."""
        stub = self.stub(health_pb2_grpc.HealthStub)
        resp = self.unary(stub.Check, health_pb2.HealthCheckRequest(service=service), idempotent=True, timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the daemon reports SERVING. Raises DeadlineExceededError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        stub = self.stub(health_pb2_grpc.HealthStub)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(f"daemon at {self.address} not serving after {timeout}s")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=min(left, 2.0), wait_for_ready=True)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)

    close_wait_s: float = 5.0
    """How long :meth:`close` waits for gRPC's channel close (normally it returns at once)."""

    def close(self) -> None:
        """Close the channel (calls in flight are cancelled, and not retried). Returns within
        :attr:`close_wait_s`: gRPC's close waits for every call of the channel to end, and a call
        whose gRPC thread could not start (a machine out of threads: "can't start new thread") never
        ends, so that close would wait forever (seen in the suite); then the close is left to a
        background thread, or skipped when no thread can start, with a WARNING."""
        self._closed = True
        try:
            closer = threading.Thread(target=self._raw_channel.close, name="kvtier-client-close", daemon=True)
            closer.start()
        except RuntimeError as e:
            log.warning("did not close the channel to %s: %s (no thread to spare)", self.address, e)
            return
        closer.join(self.close_wait_s)
        if closer.is_alive():
            log.warning("closing the channel to %s took more than %g s (a call that never started?); it goes on in "
                        "the background", self.address, self.close_wait_s)

    def __enter__(self) -> BaseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

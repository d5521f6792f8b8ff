"""Local attach, the worker's side: compute on the daemon's pool memory (README "Local attach").

``KVTierClient.attach(pool_id)`` (this module's :class:`AttachMixin`) connects to the daemon's
attach channel (``<socket>.attach`` beside its unix socket; ``kvtier.attach_wire``), presents the
client's token, receives the pool's layout and its arenas -- on the CPU memfd descriptors, which it
maps; on a GPU CUDA IPC handles, which it opens -- and builds kvtier's own
:class:`~kvtier.server.pool.DSATokenToKVPool` over them (the pool core is imported here, lazily,
for attach only; the client imports nothing else of the server). The result, an
:class:`AttachedPool`, looks like SGLang's ``DSATokenToKVPool`` to engine code: ``kv_buffer``,
``index_k_with_scale_buffer``, ``skip_topk_layers``, ``page_size``, ``size``, ``start_layer``, the
buffer infos in this process's address space, ``set_kv_buffer``, ``set_index_k_scale_buffer``,
``get_index_k_scale``, ``get_cpu_copy``, ... all on the daemon's bytes.

The connection stays open: it is the attach session. Calls through :attr:`AttachedPool.client`
(and the pool-bound helpers such as :meth:`AttachedPool.allocate_slots`) carry the session, so the
slots they allocate and the leases they take are the session's; they come back to the daemon when
the session ends -- :meth:`AttachedPool.detach`, or the process exiting, crashing or being killed.

Ordering: a worker's writes must be complete before it calls StorePrefix, Offload or a PullKV that
reads them (CPU: when the Python call that wrote returns; CUDA: synchronize the writing stream or
wait on an event); the daemon's writes (LoadPrefix, Restore, a PullKV into the pool) are complete
when the call returns.

After :meth:`AttachedPool.detach` the worker's tensors can never touch the daemon's memory again: on
the CPU each mapping is replaced in place by private zero memory (stale tensors read zeros, their
writes go nowhere shared), then the descriptors are closed; on CUDA the IPC mappings are closed.
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from kvtier.addresses import UnsafeSocketError, check_socket_path, is_unix
import torch

from kvtier.attach_wire import (
    MAX_TIMEOUT_S, PROTOCOL_VERSION, SESSION_METADATA, WireError, decode_slots, encode_keys, encode_slots, recv_message, send_message,
)
from kvtier.client.base import BaseClient
from kvtier.client.errors import (
    DeadlineExceededError, FailedPreconditionError, KVTierError, UnavailableError, from_code_name,
)
from kvtier.client.tiers import PrefixLease

HANDSHAKE_TIMEOUT_S = 30.0


def _close_fds(fds: Sequence[int]) -> None:
    import os

    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def open_channel(path: str, message: dict[str, Any], timeout: float) -> tuple[socket.socket, dict[str, Any], list[int]]:
    """Connect to the attach channel at ``path``, send the first ``message`` (attach or storage) and
    return ``(the connection, the daemon's answer, the descriptors that came with it)``.

    An answer UNAVAILABLE (the pool is busy: a call holds its lock exclusive, e.g. a transfer), an
    answer marked "changed nothing" (``unchanged``: every handshake slot of the channel taken,
    RESOURCE_EXHAUSTED) and a full listen queue (EAGAIN at connect) are retried on a new
    connection, with backoff, until
    ``timeout`` seconds have passed; an answer the
    daemon sent before closing a connection it had no room for (RESOURCE_EXHAUSTED) is read even if
    the send failed.

    Raises:
        UnavailableError: the channel is unreachable, closed without an answer, or the pool stayed
            busy. The error an answer names (``from_code_name``).
    """
    import time

    try:  # the token goes in the first message: only to a socket no other local user could have put there
        exists = check_socket_path(path)
    except UnsafeSocketError as e:
        raise FailedPreconditionError(str(e)) from None
    if not exists:
        raise UnavailableError(f"cannot reach the daemon's attach channel {path}: no such socket")
    deadline = time.monotonic() + timeout
    delay = 0.05
    busy: UnavailableError | None = None
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds: list[int] = []
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock.connect(path)
            except (BlockingIOError, InterruptedError):  # its listen queue is full for now: try again
                if time.monotonic() + 0.01 >= deadline:
                    raise UnavailableError(f"the daemon's attach channel {path} accepted no connection within "
                                           f"{timeout:g} s (its listen queue stayed full)") from None
                sock.close()
                time.sleep(0.01)  # the queue frees as the daemon accepts: try again soon
                continue
            except OSError as e:
                raise UnavailableError(f"cannot reach the daemon's attach channel {path}: {e}") from None
            try:
                send_message(sock, message)
            except OSError:
                pass  # the daemon may have answered and closed already: read what it said
            try:
                got = recv_message(sock, accept_fds=True)
            except TimeoutError:
                if busy is not None:
                    raise busy from None  # the time ran out while retrying a busy pool: say so
                raise UnavailableError(f"the daemon's attach channel {path} did not answer within {timeout:g} s") from None
            except (OSError, WireError) as e:
                raise UnavailableError(f"cannot reach the daemon's attach channel {path}: {e}") from None
            if got is None:
                raise UnavailableError("the daemon closed the attach connection without an answer")
            reply, fds = got
            if "error" in reply:
                err = _reply_error(reply)
                if (isinstance(err, UnavailableError) or err.unchanged) and time.monotonic() + delay < deadline:
                    busy = err
                    _close_fds(fds)
                    sock.close()
                    time.sleep(delay)
                    delay = min(1.0, delay * 2)
                    continue
                raise err
            return sock, reply, fds
        except BaseException:
            _close_fds(fds)
            sock.close()
            raise


#: Bytes a prefix call's request or reply may take on the attach connection: under the kernel's
#: default socket buffer (``net.core.wmem_default``, 208 KiB here), which caps one SEQPACKET message.
#: A larger call (e.g. LoadPrefix of a 20,000-token prompt: ~11 bytes a slot in base64) goes over gRPC.
CHANNEL_CALL_BYTES = 160 << 10


def _fits(n_slots: int, page_keys: Sequence[bytes]) -> bool:
    """Whether a prefix call with ``n_slots`` slots and ``page_keys`` fits one attach-connection message."""
    return 4 * -(-8 * max(int(n_slots), 0) // 3) + sum(2 * len(k) + 8 for k in page_keys) + 512 <= CHANNEL_CALL_BYTES


def _reply_error(reply: dict[str, Any]) -> Exception:
    """The client error an attach-channel reply's ``error`` (``{"code", "message"}``) stands for."""
    return from_code_name(reply["error"].get("code", ""), reply["error"].get("message", ""),
                          bool(reply["error"].get("unchanged", False)))


def request_staging(sock: socket.socket, nbytes: int, timeout: float, call_id: int) -> tuple[int, Any]:
    """Ask the daemon, on an attach session's connection ``sock``, for a new staging buffer of
    ``nbytes``: ``(its index in the session, kvtier.memfd.SharedMemory mapped here)``. The caller
    serialises requests on ``sock`` and numbers them (``call_id``, echoed in the reply): a reply that
    arrives after its own request timed out (another staging buffer's, or a prefix call's) is read
    and dropped, its descriptors closed, never taken for this request's.

    Raises:
        ResourceExhaustedError: past the session's staging budget. InvalidArgumentError: a bad size.
        UnavailableError: the connection to the daemon is gone. KVTierError: a malformed reply.
    """
    from kvtier.memfd import SharedMemory

    sock.settimeout(timeout)
    try:
        send_message(sock, {"kind": "staging", "nbytes": int(nbytes), "id": int(call_id)})
        while True:
            got = recv_message(sock, accept_fds=True)
            if got is None or got[0].get("id") == call_id:
                break
            _close_fds(got[1])  # the late reply of a call that timed out
    except (OSError, WireError) as e:
        raise UnavailableError(f"the attach connection to the daemon failed: {e}") from None
    if got is None:
        raise UnavailableError("the daemon closed the attach session")
    reply, fds = got
    if "error" in reply:
        _close_fds(fds)
        raise _reply_error(reply)
    if len(fds) != 1:
        _close_fds(fds)
        raise KVTierError("the daemon's staging reply carried no buffer")
    try:
        index, size = int(reply["staging"]["index"]), int(reply["staging"]["nbytes"])
    except (KeyError, TypeError, ValueError):
        _close_fds(fds)
        raise KVTierError("the daemon's staging reply is malformed") from None
    return index, SharedMemory.open(fds[0], size)


def _release(memory: list[Any], staging: list[Any], sock: socket.socket, client: Any) -> None:
    """Detach's work, also run by the finalizer of an AttachedPool dropped without detach(): first
    make every mapping private (so no stale tensor reaches the daemon's memory), then close the
    session's connection (the daemon gives its slots and leases back), then the session's client."""
    for m in [*memory, *staging]:
        if hasattr(m, "revoke"):
            m.revoke()
        else:
            m.close()
    memory.clear()
    staging.clear()
    try:
        sock.close()
    finally:
        client.close()


class AttachedPool:
    """A pool of the daemon, mapped into this process (see the module docstring).

    Attribute access not defined here goes to :attr:`pool`, kvtier's ``DSATokenToKVPool`` over the
    attached memory: ``ap.kv_buffer[i]`` is a ``(size + page_size, 1, kv_cache_dim)`` tensor of the
    store dtype on the daemon's bytes, ``ap.index_k_with_scale_buffer[i]`` ``(num_pages, page_size *
    132)`` uint8 (``(0, cols)`` on skip layers), ``ap.get_state_buf_infos()`` addresses in this process.

    Attributes:
        pool: the ``DSATokenToKVPool`` over the attached memory (for code that needs the real class).
        pool_id: the daemon's pool id. tenant: the tenant attached as.
        client: a :class:`~kvtier.client.KVTierClient` whose calls are made in this session.
        model: the pool's model fingerprint (name, layers, skip mask, dtypes, page size).
        device: ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, *, pool: Any, client: Any, sock: socket.socket, memory: list[Any], reply: dict[str, Any]) -> None:
        self.pool = pool
        self.client = client
        self.pool_id: str = reply["pool_id"]
        self.tenant: str = reply["tenant"]
        self.model: dict[str, Any] = reply["model"]
        self.device: str = reply["device"]
        self.staging_max_bytes: int = int(reply.get("staging_max_bytes", 0))
        self._session_id: str = reply["session_id"]
        self._sock = sock
        self._memory = memory
        self._staging: list[Any] = []
        self._lock = threading.Lock()
        self._calls = 0  # id of the last request sent on the connection
        self._orphans: list[str] = []  # leases of load replies that came after their call timed out
        self._outstanding: int | None = None  # id of a prefix call that timed out, its reply not read yet
        self._detached = False
        self._finalizer = weakref.finalize(self, _release, memory, self._staging, sock, client)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("pool", "_detached"):
            raise AttributeError(name)
        if self.__dict__.get("_detached", True):
            raise RuntimeError(f"the pool {self.__dict__.get('pool_id', '?')!r} was detached; attach again to use it")
        return getattr(self.__dict__["pool"], name)

    def __repr__(self) -> str:
        state = "detached" if self._detached else "attached"
        return f"AttachedPool({self.pool_id!r}, {self.device}, {state})"

    @property
    def attached(self) -> bool:
        """False once :meth:`detach` ran."""
        return not self._detached

    @property
    def session_id(self) -> str:
        """The session's id (a secret of this worker: never log it)."""
        return self._session_id

    # ----- the session's calls, bound to this pool ------------------------------------------
    def allocate_slots(self, num_tokens: int, **kw: Any) -> Any:
        """Allocate whole pages in this session (they are its own until freed or detached); ``(n,)`` slots."""
        return self.client.allocate_slots(self.pool_id, num_tokens, **kw)

    def free_slots(self, slots: Any, **kw: Any) -> int:
        """Free pages this session allocated."""
        return self.client.free_slots(self.pool_id, slots, **kw)

    def lookup_prefix(self, page_keys: Sequence[bytes], **kw: Any) -> Any:
        """Per tier, the longest prefix of ``page_keys`` present (pins nothing)."""
        return self.client.lookup_prefix(self.pool_id, page_keys, **kw)

    # The prefix calls go over the attach connection itself (one SEQPACKET message each way, no
    # HTTP/2: ~3x less time a call than gRPC here, BENCHMARKS.md fix 15), with the checks, errors
    # and lease ownership of the gRPC methods; ``self.client``'s methods are the same calls over gRPC.
    def load_prefix(self, page_keys: Sequence[bytes], total_tokens: int | None = None, *,
                    timeout: float | None = None) -> PrefixLease:
        """Load the present prefix into the pool (read it through the tensors once this returns) and
        allocate fresh slots for the rest; the lease is this session's (released at detach at the latest).

        Raises:
            ResourceExhaustedError: the pool cannot make room; nothing changed. InvalidArgumentError:
                bad or repeated keys. UnavailableError: a tier is unhealthy, or the connection is gone.
        """
        n = total_tokens if total_tokens is not None else len(page_keys) * int(self.pool.page_size)
        if not _fits(n, page_keys):  # a reply larger than one message of the connection: over gRPC
            return self.client.load_prefix(self.pool_id, page_keys, total_tokens, timeout=timeout)
        reply = self._call({"kind": "load_prefix", "keys": encode_keys(page_keys), "total_tokens": total_tokens}, timeout)
        try:
            raw = decode_slots(reply["slots"])
            slots = torch.frombuffer(bytearray(raw), dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64)
            return PrefixLease(self.pool_id, str(reply["lease_id"]), slots, [str(t) for t in reply["tiers"]])
        except (KeyError, TypeError, WireError) as e:
            raise KVTierError(f"the daemon's load_prefix reply is malformed: {e}") from None

    def store_prefix(self, lease: PrefixLease, page_keys: Sequence[bytes], slots: Any, *, release: bool = False,
                     timeout: float | None = None) -> int:
        """Hand the lease's fresh pages, written through the tensors (writes complete first), to the
        cache; returns the pages adopted. ``release``: end the lease in the same call.

        Raises:
            InvalidArgumentError: not the lease's fresh pages, bad keys. NotFoundError: not this session's lease.
        """
        raw = torch.as_tensor(slots, dtype=torch.int64).reshape(-1).contiguous().numpy().astype("<i8", copy=False).tobytes()
        if not _fits(len(raw) // 8, page_keys):
            return self.client.store_prefix(lease, page_keys, slots, release=release, timeout=timeout)
        reply = self._call({"kind": "store_prefix", "lease_id": lease.lease_id, "keys": encode_keys(page_keys),
                            "slots": encode_slots(raw), "release": bool(release)}, timeout)
        return int(reply.get("stored_pages", 0))

    def release_prefix(self, lease: PrefixLease, *, timeout: float | None = None) -> None:
        """End a lease (its pages may be evicted and reused afterwards: stop reading them first).
        Raises NotFoundError for a lease that is not this session's or was released."""
        self._call({"kind": "release_prefix", "lease_id": lease.lease_id}, timeout)

    def _call(self, message: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """Send one request on the session's connection and return its reply (matched by ``id``: a
        reply that arrives after its call timed out is read and dropped by the next call).

        The daemon runs one prefix call of a connection at a time. A call that timed out may still
        be running there, so the next call first waits, within its own timeout, for that call's
        reply (read and dropped; a load's lease released) and only then sends: it is not refused
        RESOURCE_EXHAUSTED for the old call (attack pass 9, A9-6). If the old reply does not come
        in time, the call raises DeadlineExceededError without having sent anything."""
        wait = timeout if timeout is not None else getattr(self.client, "timeout", 30.0)
        end = time.monotonic() + wait
        with self._lock:
            if self._detached:
                raise RuntimeError("the pool was detached; attach again to use it")
            try:
                self._settle_outstanding(end)
                self._calls += 1
                message["id"] = self._calls
                if 0 < wait <= MAX_TIMEOUT_S:  # the daemon changes nothing for a caller that gave up (A8-6)
                    message["timeout_s"] = wait
                self._sock.settimeout(max(end - time.monotonic(), 1e-3))
                message["sent_at"] = time.monotonic()  # the daemon counts the timeout from here (A9-1)
                send_message(self._sock, message)
                try:
                    reply = self._read_until(self._calls, end)
                except TimeoutError:
                    self._outstanding = self._calls
                    raise
                while self._orphans:  # released now, best effort (the session's end would release them too)
                    self._calls += 1
                    send_message(self._sock, {"kind": "release_prefix", "lease_id": self._orphans.pop(), "id": self._calls})
                    while (got := recv_message(self._sock)) is not None and got[0].get("id") != self._calls:
                        pass
            except TimeoutError:
                raise DeadlineExceededError(f"the daemon did not answer {message['kind']} within {wait:g} s") from None
            except (OSError, WireError) as e:
                raise UnavailableError(f"the attach connection to the daemon failed: {e}") from None
        if "error" in reply:
            raise _reply_error(reply)
        return reply

    def _settle_outstanding(self, end: float) -> None:
        """(Lock held) Read the reply of the prefix call that timed out, if one is still due, by
        ``end``: nothing else may be sent before it (the daemon runs one prefix call of a connection
        at a time). A late load's lease is kept to be released. Raises TimeoutError past ``end``."""
        if self._outstanding is None:
            return
        late = self._read_until(self._outstanding, end)
        self._outstanding = None
        if "lease_id" in late and "slots" in late:
            self._orphans.append(str(late["lease_id"]))

    def _read_until(self, call_id: int, end: float) -> dict[str, Any]:
        """(Lock held) Read replies until the one of ``call_id``, by ``end`` (``time.monotonic()``);
        others are dropped (a late load's lease is kept to be released, a late staging reply's
        descriptor closed). Raises TimeoutError past ``end``."""
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)
            got = recv_message(self._sock, accept_fds=True)
            if got is None:
                raise UnavailableError("the daemon closed the attach session")
            reply = got[0]
            _close_fds(got[1])  # (a staging buffer whose request timed out: its descriptor)
            if reply.get("id") == call_id:
                return reply
            if "lease_id" in reply and "slots" in reply:  # a load that timed out: nobody holds its lease
                self._orphans.append(str(reply["lease_id"]))

    def offload(self, key: str, slots: Any, *, free_slots: bool = False, **kw: Any) -> Any:
        """Copy ``slots`` (as written through the tensors) into the host tier under ``key``."""
        return self.client.offload(self.pool_id, key, slots, free_slots=free_slots, **kw)

    def restore(self, key: str, slots: Any = None, *, drop: bool = False, **kw: Any) -> Any:
        """Load the copy under ``key`` into ``slots`` (or fresh slots of this session); read them once this returns."""
        return self.client.restore(self.pool_id, key, slots, drop=drop, **kw)

    def where_is(self, page_keys: Sequence[bytes], **kw: Any) -> list[list[str]]:
        """The tiers holding each key's page."""
        return self.client.where_is(self.pool_id, page_keys, **kw)

    # ----- staging buffers --------------------------------------------------------------------
    def staging_buffer(self, nbytes: int, *, timeout: float = HANDSHAKE_TIMEOUT_S) -> Any:
        """A new ``(nbytes,)`` uint8 tensor in shared memory of this session alone, which the daemon
        maps too (for page transfers; freed at detach). At most ``staging_max_bytes`` in all.

        Raises:
            ResourceExhaustedError: past the session's staging budget. InvalidArgumentError: a bad size.
            RuntimeError: detached. UnavailableError: the connection to the daemon is gone.
        """
        with self._lock:
            if self._detached:
                raise RuntimeError("the pool was detached")
            try:
                self._settle_outstanding(time.monotonic() + timeout)
            except TimeoutError:
                raise DeadlineExceededError(f"the daemon did not answer an earlier call within {timeout:g} s") from None
            except (OSError, WireError) as e:
                raise UnavailableError(f"the attach connection to the daemon failed: {e}") from None
            self._calls += 1
            _, shm = request_staging(self._sock, nbytes, timeout, self._calls)
            self._staging.append(shm)
            return shm.tensor()

    # ----- lifetime -----------------------------------------------------------------------------
    def detach(self) -> None:
        """End the session: make this process's mappings private (stale tensors read zeros and write
        nowhere shared; on CUDA the IPC mappings are closed), then close the connection, so the daemon
        frees the session's slots and releases its leases. Idempotent."""
        with self._lock:
            if self._detached:
                return
            self._detached = True
        self._finalizer()

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


class AttachMixin(BaseClient):
    """``attach(pool_id)``: map a pool of a daemon on this machine (module docstring)."""

    def attach_socket(self, *, timeout: float | None = None) -> str:
        """The daemon's attach channel socket (asked with GetStats).

        Raises:
            FailedPreconditionError: this client or the daemon is on TCP (attach needs the unix socket).
        """
        if not is_unix(self.address):
            raise FailedPreconditionError(
                f"attach needs the daemon's unix socket on this machine; this client talks to {self.address} over TCP "
                f"(use the daemon's socket path, e.g. KVTierClient('/run/kvtier/kvtier.sock'))")
        path = self.stats(timeout=timeout).attach_socket  # type: ignore[attr-defined]
        if not path:
            raise FailedPreconditionError("the daemon serves no attach channel (it listens on TCP); attach needs the "
                                          "daemon's unix socket on this machine")
        return path

    def attach(self, pool_id: str, *, timeout: float = HANDSHAKE_TIMEOUT_S) -> AttachedPool:
        """Map pool ``pool_id`` of the daemon into this process (see :class:`AttachedPool`).

        Raises:
            FailedPreconditionError: the daemon or this client is on TCP, the pool cannot be attached
                (not in shared memory, another device), or the layout the daemon describes is not
                the one this client builds (client and daemon of different versions).
            NotFoundError: no such pool for this caller (also: another tenant's pool, or a uid that may
                not attach). UnauthenticatedError: no known token. UnavailableError: the channel is
                unreachable, or the pool stayed busy for ``timeout`` seconds. ResourceExhaustedError: the
                tenant's or the daemon's session cap.
        """
        path = self.attach_socket(timeout=timeout)
        sock, reply, fds = open_channel(path, {"kind": "attach", "version": PROTOCOL_VERSION, "token": self._token,
                                               "pool_id": pool_id}, timeout)
        try:
            memory, arenas = _map_arenas(reply, fds)
            fds = []  # owned by the mappings now
            try:
                pool = _build_pool(reply, arenas)
                client = type(self)(self.address, timeout=self.timeout, max_message_bytes=self.max_message_bytes,
                                    chunk_bytes=self.chunk_bytes, retries=self.retries, token=self._token,
                                    metadata=[(SESSION_METADATA, reply["session_id"])], **self._tls)
            except BaseException:
                for m in memory:
                    m.revoke() if hasattr(m, "revoke") else m.close()
                raise
            sock.settimeout(None)
            return AttachedPool(pool=pool, client=client, sock=sock, memory=memory, reply=reply)
        except BaseException:
            _close_fds(fds)
            sock.close()
            raise


def _map_arenas(reply: dict[str, Any], fds: list[int]) -> tuple[list[Any], dict[str, Any]]:
    """Map each arena the reply lists: ``(mappings to revoke/close at detach, {component: tensor})``."""
    from kvtier.memfd import SharedMemory

    memory: list[Any] = []
    arenas: dict[str, Any] = {}
    used: set[int] = set()
    try:
        for a in reply["arenas"]:
            if reply["device"] == "cpu":
                i = int(a["fd_index"])
                if not 0 <= i < len(fds) or i in used:
                    raise FailedPreconditionError("the daemon's attach reply names a descriptor it did not send")
                used.add(i)
                shm = SharedMemory.open(fds[i], int(a["nbytes"]))
                memory.append(shm)
                arenas[a["component"]] = shm.tensor()
            else:
                from kvtier.cuda_ipc import CudaIpcError, open_arena

                try:
                    cuda = open_arena(a["cuda"])
                except CudaIpcError as e:
                    raise FailedPreconditionError(str(e)) from None
                memory.append(cuda)
                arenas[a["component"]] = cuda.tensor
        _close_fds([fd for i, fd in enumerate(fds) if i not in used])
    except BaseException:
        _close_fds([fd for i, fd in enumerate(fds) if i not in used])
        for m in memory:
            m.revoke() if hasattr(m, "revoke") else m.close()
        raise
    return memory, arenas


def _build_pool(reply: dict[str, Any], arenas: dict[str, Any]) -> Any:
    """kvtier's pool over the mapped arenas, checked view by view against the daemon's."""
    from kvtier.server.pool.layout import pool_from_geometry, pool_views

    try:
        pool = pool_from_geometry(reply["geometry"], device=next(iter(arenas.values())).device if arenas else "cpu",
                                  arenas=arenas)
    except (TypeError, ValueError) as e:
        raise FailedPreconditionError(f"cannot build the attached pool (client and daemon versions differ?): {e}") from None
    mine, theirs = pool_views(pool), reply["views"]
    if mine != theirs:
        raise FailedPreconditionError("the attached pool's views differ from the daemon's (client and daemon versions "
                                      "differ?); refusing to use them")
    return pool

"""Shared fixtures: real kvtier daemons as subprocesses (over a unix socket and over 127.0.0.1).

``daemon`` is session-scoped and parametrised over both transports, so every test that uses it
runs once per transport. Each test gets its own small pool (``pool`` fixture: the first 8 layers of
GLM-5.2, 1,024 tokens; skip mask ``FFFSSSFS``) and deletes it afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess

# The longest tests (about 75 s each on 2 cores), started first. Under pytest-xdist (README's test
# command: -n 2 --dist worksteal) a worker that runs out of tests takes tests from the end of the other's
# queue: started last, one of these would run alone at the end, and the bench file's tests, split between
# the workers, would run its module fixture (the whole `kvtier bench --quick`) on both.
RUN_FIRST = ("tests/integrations/test_sglang_suite.py::", "tests/kvtier/bench/test_bench_cli.py::")


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture (neither uses the shared `daemon`)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(RUN_FIRST))  # stable: the rest keep their order

# Budgets the error tests rely on: a small host tier and a cap on all pools' bytes.
DAEMON_ARGS = ["--device", "cpu", "--host-memory", "4MiB", "--pool-memory", "256MiB", "--log-level", "WARNING"]
TRANSPORTS = {"unix": None, "tcp": "127.0.0.1:0"}


@pytest.fixture(scope="session", params=sorted(TRANSPORTS))
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A running daemon (``.address``, ``.process``) shared by the session, one per transport."""
    with DaemonProcess(TRANSPORTS[request.param], extra_args=DAEMON_ARGS) as d:
        yield d


@pytest.fixture()
def client(daemon: DaemonProcess) -> Iterator[KVTierClient]:
    """A client of ``daemon`` with a 30 s deadline per call."""
    with KVTierClient(daemon.address, timeout=30.0) as c:
        yield c


@pytest.fixture()
def pool(client: KVTierClient) -> Iterator[str]:
    """Id of a fresh GLM-5.2 pool (first 8 layers, 1,024 tokens = 16 pages, fp8) deleted after the test."""
    pool_id = f"test-{uuid.uuid4().hex[:8]}"
    client.create_pool("glm-5.2", num_layers=8, size_tokens=1024, pool_id=pool_id)
    yield pool_id
    client.delete_pool(pool_id, force=True)

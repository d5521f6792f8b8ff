"""Shared fixtures: real kvtier daemons as subprocesses (over a unix socket and over 127.0.0.1).

``daemon`` is session-scoped and parametrised over both transports, so every test that uses it
runs once per transport. Each test gets its own small pool (``pool`` fixture: the first 8 layers of
GLM-5.2, 1,024 tokens; skip mask ``FFFSSSFS``) and deletes it afterwards.
"""

from __future__ import annotations

import os
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
    with DaemonProcess(TRANSPORTS[request.param], allow_unauthenticated=True, extra_args=DAEMON_ARGS) as d:
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


# ----- the summary line says what was left out, and why ------------------------------------------------
# The default run deselects tests marked slow or cuda (pyproject's addopts: -m 'not slow and not cuda');
# pytest would count them as "N deselected". The final line names them instead, e.g.
# "1005 passed, 9 left out as slow (run: -m slow), 6 left out as cuda (need a GPU: -m cuda) in 480s".
# Under pytest-xdist the workers collect and deselect; each sends its counts to the controller.
LEFT_OUT_WHY = {"slow": "left out as slow (run: -m slow)", "cuda": "left out as cuda (need a GPU: -m cuda)"}
_LEFT_OUT = pytest.StashKey[dict]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_LEFT_OUT] = {}


def pytest_deselected(items: list[pytest.Item]) -> None:
    if not items:
        return
    counts = items[0].config.stash[_LEFT_OUT]
    for item in items:
        mark = next((m for m in LEFT_OUT_WHY if item.get_closest_marker(m)), "other")
        counts[mark] = counts.get(mark, 0) + 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the counts to the controller
        session.config.workeroutput["kvtier_left_out"] = dict(session.config.stash[_LEFT_OUT])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001  (xdist's hook, on the controller)
    counts = getattr(node, "workeroutput", {}).get("kvtier_left_out")
    if counts:  # every worker collects and deselects the same tests: keep one worker's counts
        node.config.stash[_LEFT_OUT] = counts


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001
    counts = config.stash.get(_LEFT_OUT, {})
    if not any(counts.get(m) for m in LEFT_OUT_WHY):
        return
    stats = terminalreporter.stats
    deselected = stats.pop("deselected", [])
    for mark, why in LEFT_OUT_WHY.items():
        if counts.get(mark):
            stats[why] = [None] * counts[mark]
    other = counts.get("other", 0) or (len(deselected) - sum(counts.get(m, 0) for m in LEFT_OUT_WHY))
    if other > 0:
        stats["deselected"] = [None] * other


@pytest.fixture
def others_symlink(tmp_path):
    """A sticky 1777 directory holding uid 65534's symlink ``evil`` to a root-only 0700 directory
    (``/tmp`` with another user's link in it); returns ``(sticky dir, target dir)``. The tests run as root."""
    assert os.getuid() == 0, "the suite runs as root (it chowns a symlink to another uid)"
    sticky, victim = tmp_path / "sticky", tmp_path / "victim"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    victim.mkdir(mode=0o700)
    (sticky / "evil").symlink_to(victim)
    os.lchown(sticky / "evil", 65534, 65534)
    return sticky, victim


@pytest.fixture
def make_node(tmp_path):
    """``make_node(kind)``: our own FIFO (``"fifo"``) or character device with /dev/zero's numbers
    (``"char-device"``; mknod needs root, which the suite runs as) at ``tmp_path/node``; returns its path.
    Never the real /dev nodes."""
    import stat

    def make(kind: str):
        node = tmp_path / "node"
        if kind == "fifo":
            os.mkfifo(node)
        else:
            assert os.geteuid() == 0, "mknod needs root (the suite runs as root)"
            os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        return node

    return make

"""Every file and directory the daemon makes is its user's alone, whatever the umask.

Regression (issue 23, defect 2): under umask 022 the disk directory was made 0755 and ``data.mdb`` /
``lock.mdb`` 0644, so a process of uid ``nobody`` -- refused by the 0600 socket -- read a tenant's
offloaded KV bytes straight out of ``data.mdb``. The tests run the daemon under umask 022 in a 0755
directory under /tmp (pytest's own temp root is 0700 and would hide the defect) and try to read its
files as ``nobody`` (``setpriv``, as tests/client/test_attach_security.py does).

Policy for an existing ``--disk-path`` (README, Security): one with a group or other mode bit, or owned
by another uid, or LMDB files in it that are, is refused with the chmod to run; the daemon never
changes the mode of something it did not create.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kv_helpers import offload_page, verify_restored_page

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.server.tiers.disk_faults import check_disk_path
from kvtier.server.tiers.errors import DiskPathError

NOBODY = 65534
POOL = "off"

_READ_AS_OTHER = """
import json, os, sys
out = {}
for p in sys.argv[1:]:
    try:
        if os.path.isdir(p):
            out[p] = sorted(os.listdir(p))
        else:
            with open(p, "rb") as f:
                out[p] = len(f.read())
    except OSError as e:
        out[p] = e.errno
print(json.dumps(out))
"""


def read_as(uid: int, *paths: Path) -> dict[str, object]:
    """What a process of ``uid`` gets for each path: a directory's names, a file's byte count, or the
    errno (13: EACCES). Started with setpriv (see test_attach_security.run_as for why not ``user=``)."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", python, "-I", "-c",
                        _READ_AS_OTHER, *map(str, paths)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture()
def open_parent(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A 0755 directory under /tmp (anyone may look in), with the process umask 022 meanwhile."""
    assert os.getuid() == 0, "these tests start a process as another user"
    parent = Path(tempfile.mkdtemp(prefix="kvtier-modes-"))
    os.chmod(parent, 0o755)
    old = os.umask(0o022)
    try:
        yield parent
    finally:
        os.umask(old)
        shutil.rmtree(parent, ignore_errors=True)


def daemon(disk: Path) -> DaemonProcess:
    return DaemonProcess(extra_args=["--device", "cpu", "--log-level", "WARNING", "--pool", f"{POOL}=glm-5.2:1024",
                                     "--pool-layers", "4", "--host-memory", "4MiB", "--disk-path", str(disk),
                                     "--disk-size", "64MiB", "--write-through"])


def test_another_uid_cannot_read_the_disk_tier_or_the_daemons_files(open_parent):
    """A fresh ``--disk-path`` (and its missing parent) is 0700 and the LMDB files 0600 under umask 022;
    ``nobody`` can neither list the directory nor read ``data.mdb``, which holds a durable copy. The
    ready file and the daemon's log are 0600 too."""
    disk = open_parent / "var" / "disk"
    with daemon(disk) as d, KVTierClient(d.address, timeout=60) as c:
        assert offload_page(c, POOL, "secret", seed=23).durable  # write-through: committed to data.mdb
        assert (disk / "data.mdb").stat().st_size > 194_048  # the copy's bytes are in the file
        got = read_as(NOBODY, disk, disk / "data.mdb", disk / "lock.mdb")
        assert got == {str(disk): 13, str(disk / "data.mdb"): 13, str(disk / "lock.mdb"): 13}, got
        assert (mode(open_parent / "var"), mode(disk)) == (0o700, 0o700)
        assert (mode(disk / "data.mdb"), mode(disk / "lock.mdb")) == (0o600, 0o600)
        ready = Path(d.log_path).parent / "ready"
        assert (mode(ready), mode(d.log_path)) == (0o600, 0o600)
        verify_restored_page(c, POOL, "secret", seed=23)


def test_a_loose_existing_disk_path_is_refused_with_the_chmod_to_run(open_parent):
    """A disk path left 0755 with 0644 files (by an older kvtier, or ``mkdir`` under umask 022) is
    refused at start with one line naming the path, its mode and the chmod; modes are left as they
    were (the daemon never chmods what it did not create). After the chmods it starts and serves the
    records in it."""
    disk = open_parent / "disk"
    with daemon(disk) as d, KVTierClient(d.address, timeout=60) as c:
        assert offload_page(c, POOL, "kept", seed=5).durable
    os.chmod(disk, 0o755)
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(disk / name, 0o644)
    assert read_as(NOBODY, disk / "data.mdb")[str(disk / "data.mdb")] == (disk / "data.mdb").stat().st_size
    with pytest.raises(RuntimeError) as e:
        daemon(disk).start()
    assert (f"--disk-path directory {disk} is mode 0755: other users could read the KV bytes in it; "
            f"run chmod 700 {disk}") in str(e.value) and "Traceback" not in str(e.value)
    assert (mode(disk), mode(disk / "data.mdb")) == (0o755, 0o644)
    os.chmod(disk, 0o700)
    with pytest.raises(RuntimeError) as e:  # the directory alone is not enough: a file might be linked elsewhere
        daemon(disk).start()
    assert f"--disk-path file {disk / 'data.mdb'} is mode 0644" in str(e.value) and f"run chmod 600 {disk / 'data.mdb'}" in str(e.value)
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(disk / name, 0o600)
    with daemon(disk) as d, KVTierClient(d.address, timeout=60) as c:
        verify_restored_page(c, POOL, "kept", seed=5)
        assert read_as(NOBODY, disk / "data.mdb") == {str(disk / "data.mdb"): 13}


def test_a_disk_path_another_uid_owns_is_refused_with_one_line(open_parent):
    """Another user's directory (it could loosen it again, or swap the files) is refused at start, and
    its mode is left as it was."""
    disk = open_parent / "theirs"
    disk.mkdir(mode=0o700)
    os.chown(disk, NOBODY, NOBODY)
    d = daemon(disk)
    with pytest.raises(RuntimeError) as e:
        d.start()
    assert f"--disk-path directory {disk} is owned by uid {NOBODY}, not by this daemon's uid 0;" in str(e.value)
    assert "Traceback" not in str(e.value)
    assert mode(disk) == 0o700 and os.stat(disk).st_uid == NOBODY and not (disk / "data.mdb").exists()


def test_a_shared_directory_is_refused_and_left_as_it_was(open_parent):
    """A world-writable sticky directory (what /tmp and a fresh tmpfs mount are) is refused, never
    chmod'ed: other users live in it."""
    shared = open_parent / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(DiskPathError, match=f"directory {shared} is mode 1777: other users could read"):
        check_disk_path(shared)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777


def test_a_symlinked_disk_path_is_judged_by_its_directory_and_a_symlinked_lmdb_file_is_refused(open_parent):
    """``--disk-path`` may be a symlink (``/data -> /mnt/nvme/kvtier``): the directory it names is
    checked. An LMDB file that is a symlink is refused: the bytes would live wherever it points."""
    real = open_parent / "real"
    real.mkdir(mode=0o700)
    os.chmod(real, 0o700)
    link = open_parent / "link"
    link.symlink_to(real)
    assert check_disk_path(link) == link
    os.chmod(real, 0o750)
    with pytest.raises(DiskPathError, match=f"directory {real} is mode 0750"):
        check_disk_path(link)
    os.chmod(real, 0o700)
    elsewhere = open_parent / "data.mdb"
    elsewhere.write_bytes(b"")
    os.chmod(elsewhere, 0o600)
    (real / "data.mdb").symlink_to(elsewhere)
    with pytest.raises(DiskPathError, match=f"file {real / 'data.mdb'} is not a plain file"):
        check_disk_path(link)


def test_a_disk_path_another_user_could_redirect_is_refused(open_parent):
    """Attack pass 4, A4-3: a --disk-path below a directory of uid 65534 was accepted; that user then
    renamed the disk directory away and put a symlink to any root-owned 0700 directory in its place,
    and the next start created LMDB there (or served another daemon's records from it). A symlink of
    another uid at the path (planted in sticky /tmp before the daemon made the directory) was
    followed and trusted too. Now the way to the path gets the socket paths' check: each directory
    on it owned by root or this uid and not writable by others without the sticky bit, each symlink
    owned by root or this uid. Nothing is created in either case."""
    theirs = open_parent / "nobodys"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(DiskPathError, match=f"refusing --disk-path {theirs / 'disk'}: directory {theirs} is owned by "
                                            f"uid {NOBODY}, not by root or this uid 0 \\(another user's"):
        check_disk_path(theirs / "disk")
    assert not (theirs / "disk").exists()
    target = open_parent / "root-private"
    target.mkdir(mode=0o700)
    sticky = open_parent / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    planted = sticky / "kvtier-disk"
    planted.symlink_to(target)
    os.lchown(planted, NOBODY, NOBODY)
    with pytest.raises(DiskPathError, match=f"symlink {planted} is owned by uid {NOBODY}"):
        check_disk_path(planted)
    assert list(target.iterdir()) == []
    loose = open_parent / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(DiskPathError, match=rf"directory {loose} \(mode 0777\) is writable by group or others without "
                                            f"the sticky bit"):
        check_disk_path(loose / "disk")
    assert not (loose / "disk").exists()
    mine = open_parent / "mine"
    mine.mkdir(mode=0o700)
    assert check_disk_path(mine / "disk") == mine / "disk"  # a way only root and this uid control: made 0700

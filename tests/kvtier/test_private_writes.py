"""``kvtier.private_writes``: what kvtier writes is its user's alone whatever the umask, and a write is
never stopped or diverted by what another user left beside it."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from kvtier.private_writes import OutputPathError, check_output_path, private_dirs, save_private_figure, write_private_file


def mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_new_directories_are_0700_and_an_existing_one_is_left_as_it_was(tmp_path, umask_022):
    os.chmod(tmp_path, 0o755)
    made = private_dirs(tmp_path / "a" / "b")
    assert made == tmp_path / "a" / "b"
    assert (mode(tmp_path), mode(tmp_path / "a"), mode(made)) == (0o755, 0o700, 0o700)
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    private_dirs(open_dir)
    assert mode(open_dir) == 0o755  # not ours to chmod


def test_a_file_is_0600_replaces_what_was_there_and_leaves_no_temporary_file(tmp_path, umask_022):
    target = tmp_path / "results.json"
    target.write_text("old")
    os.chmod(target, 0o644)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep")
    write_private_file(target, "new")
    assert (target.read_text(), mode(target)) == ("new", 0o600)
    assert elsewhere.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "results.json"]


def _special(tmp_path, kind):
    """A thing that is not a regular file at ``tmp_path / kind`` (our own: never the real /dev/null)."""
    p = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(p, 0o600)
    elif kind == "char-device":
        assert os.geteuid() == 0, "mknod needs root: the suite runs as root (as for its tmpfs disks)"
        os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_text("keep")
        p.symlink_to(tmp_path / "elsewhere")
    else:
        p.mkdir()
    return p, os.lstat(p)


@pytest.mark.parametrize(("kind", "words"), [("fifo", "a FIFO"), ("char-device", "a character device"),
                                             ("socket", "a socket"), ("symlink", "a symlink"), ("directory", "a directory")])
def test_only_a_regular_file_is_replaced(tmp_path, kind, words):
    """Attack pass 7, A7-6: ``--ready-file`` and ``kvtier replay --json`` renamed a 0600 file over whatever
    was at the path: a device node (as root, /dev/null for everyone), a FIFO, the daemon's own socket.
    Now the check at start and the write itself refuse anything but a regular file, in one line naming
    the path and what is there, and leave it as it was (no temporary file either). A symlink is refused
    too (replacing it cut the link silently)."""
    p, before = _special(tmp_path, kind)
    names = sorted(os.listdir(tmp_path))
    for attempt in (lambda: check_output_path(p, "--json"), lambda: write_private_file(p, "new", "--json")):
        with pytest.raises(OutputPathError) as info:
            attempt()
        assert str(info.value) == (f"--json {p} is {words}, not a regular file: kvtier writes a new file or "
                                   f"replaces a regular one only; remove it or give another path")
    after = os.lstat(p)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)
    assert sorted(os.listdir(tmp_path)) == names
    if kind == "symlink":
        assert (tmp_path / "elsewhere").read_text() == "keep"


def test_a_stale_fixed_temporary_name_is_not_in_the_way(tmp_path):
    """Regression (attack pass F2): the ready file went through ``FILE.tmp``, which another user could
    create first (here a directory): the write failed. The temporary name is random now."""
    (tmp_path / "ready.tmp").mkdir()
    write_private_file(tmp_path / "ready", "unix:///x")
    assert (tmp_path / "ready").read_text() == "unix:///x" and (tmp_path / "ready.tmp").is_dir()


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(OutputPathError, match="is a directory, not a regular file"):
        write_private_file(tmp_path / "adir", "x")
    with pytest.raises(FileNotFoundError):
        write_private_file(tmp_path / "missing" / "f", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"] and not any((tmp_path / "adir").iterdir())


def test_a_figure_is_saved_0600(tmp_path, umask_022):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    save_private_figure(fig, tmp_path / "plot.png", dpi=50)
    plt.close(fig)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and mode(tmp_path / "plot.png") == 0o600


def test_another_users_symlink_on_the_way_is_refused_before_anything_is_written(others_symlink):
    """Attack pass 8, A8-12: the output checks looked at the last name only, so a path through another
    user's symlink in a sticky directory wrote (as root) into the directory it points at. The rule of
    the sockets and the ready file now holds for every output: each refusal names the symlink and its
    owner in one line, and the root-only directory stays empty."""
    sticky, victim = others_symlink
    for call in (lambda: check_output_path(sticky / "evil" / "out.json", "--json"),
                 lambda: write_private_file(sticky / "evil" / "out.json", "{}", "--json"),
                 lambda: private_dirs(sticky / "evil" / "benchout", "--out")):
        with pytest.raises(OutputPathError) as e:
            call()
        assert f"symlink {sticky / 'evil'} is owned by uid 65534" in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(victim) == []
    own = sticky / "mine.json"  # this user's own file in the same sticky directory is fine
    write_private_file(own, "{}")
    assert own.read_text() == "{}"

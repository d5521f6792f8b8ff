"""``kvtier.private_writes``: what kvtier writes is its user's alone whatever the umask, and a write is
never stopped or diverted by what another user left beside it."""

from __future__ import annotations

import os
import stat

import pytest

from kvtier.private_writes import private_dirs, save_private_figure, write_private_file


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
    link = tmp_path / "link.json"
    link.symlink_to(elsewhere)
    write_private_file(target, "new")
    write_private_file(link, b"bytes")
    assert (target.read_text(), mode(target)) == ("new", 0o600)
    assert not link.is_symlink() and link.read_bytes() == b"bytes" and mode(link) == 0o600
    assert elsewhere.read_text() == "keep"  # a symlink is replaced, never written through
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link.json", "results.json"]


def test_a_stale_fixed_temporary_name_is_not_in_the_way(tmp_path):
    """Regression (attack pass F2): the ready file went through ``FILE.tmp``, which another user could
    create first (here a directory): the write failed. The temporary name is random now."""
    (tmp_path / "ready.tmp").mkdir()
    write_private_file(tmp_path / "ready", "unix:///x")
    assert (tmp_path / "ready").read_text() == "unix:///x" and (tmp_path / "ready.tmp").is_dir()


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError):
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

"""minitransformer.files: a file is written whole or not at all, a killed write's leftovers are
found and removed (only those of an ended owner), and nothing that is not a regular file or a
folder is replaced, followed into or deleted."""

import errno
import logging
import os
import pathlib
import stat
import subprocess
import sys
import threading

import pytest

from minitransformer import files
from tests.helpers import ended_process, fill, tmpfs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_target_gets_the_content_with_the_usual_permissions(tmp_path):
    path = tmp_path / "new" / "a.json"  # the folder is created
    with files.atomic_write(path) as f:
        f.write("ünïcode\n")
    with files.atomic_write(tmp_path / "b.bin", "wb") as f:
        f.write(b"\x00\xff")
    assert path.read_text(encoding="utf-8") == "ünïcode\n" and (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "b.bin", "new"]


def test_an_error_mid_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("old\n")
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_write(path) as f:
            f.write("half of the new")
            f.flush()
            assert [p.name.startswith(files.PREFIX + "log.jsonl-") for p in tmp_path.iterdir()].count(True) == 1
            raise KeyboardInterrupt
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]


def test_append_or_read_modes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mode 'w' or 'wb', not 'a'"):
        with files.atomic_write(tmp_path / "x", "a"):
            pass


def test_only_an_ended_process_s_leftovers_on_this_host_are_removed(tmp_path, caplog):
    pid, start = ended_process()
    host = files._host()
    mine = files._temporary_prefix(str(tmp_path / "x"))  # this live process's
    dead = {f".tmp-last.npz-@{host}:{pid}.{start}-abc123": "file", f".tmp-export-@{host}:{pid}.{start}-k1_x": "folder",
            f".tmp-export-@{host}:{pid}.{start}-k1_x-old": "folder", f".tmp-log.jsonl-@{host}:{pid}-zz9": "file",
            # an earlier process that had this one's pid (a container started again)
            f".tmp-last.npz-@{host}:{os.getpid()}.{int(files._process_start('self')) - 1}-reused": "file"}
    kept = {mine + "live01": "file",
            f".tmp-last.npz-@elsewhere:{pid}.{start}-abc": "file", ".tmp-k1ll3d.npz": "file",  # a user's name
            ".tmp-users-folder": "folder", "last.npz": "file", ".hidden": "file",
            "export": "folder"}  # in place: the "-old" beside it is the one it replaced
    for name, kind in {**dead, **kept}.items():
        if kind == "folder":
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.bin").write_bytes(b"half")
        else:
            (tmp_path / name).write_bytes(b"x")
    os.symlink(tmp_path / "last.npz", tmp_path / f".tmp-link-@{host}:{pid}.{start}-lnk")  # not ours: kept
    with caplog.at_level("WARNING", logger="minitransformer.files"):
        assert files.remove_unfinished_writes(tmp_path) == sorted(dead)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, f".tmp-link-@{host}:{pid}.{start}-lnk"])
    assert (tmp_path / "last.npz").read_bytes() == b"x"
    assert "on host elsewhere" in caplog.text
    assert files.remove_unfinished_writes(tmp_path) == []


def test_a_temporary_name_is_its_owner_s_and_parsed_back():
    owner = files._OWNED.match(files._temporary_prefix("/a/b/ckpt-1.npz") + "ab_9x")
    assert (owner["host"], int(owner["pid"]), owner["start"]) == (files._host(), os.getpid(),
                                                                     files._process_start(os.getpid()))
    assert files._owner_alive(int(owner["pid"]), owner["start"])
    assert not files._owner_alive(*ended_process())
    long = files._temporary_prefix("/a/" + "n" * 255)
    assert len(long.encode()) + 8 <= 255  # mkstemp's random part fits NAME_MAX


def test_a_link_to_a_file_is_written_through_and_kept(tmp_path):
    target, link = tmp_path / "real" / "out.de", tmp_path / "out.de"
    target.parent.mkdir()
    target.write_text("old\n")
    os.chmod(target, 0o640)
    link.symlink_to(target)
    with files.atomic_write(link) as f:
        f.write("new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # a file replaced keeps its permissions
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out.de", "out.de", "real"]


def test_a_fifo_is_written_as_a_stream_not_replaced(tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    with files.atomic_write(fifo, partial=tmp_path / "out.partial") as f:
        f.write("a line\n")
    reader.join(timeout=30)
    assert got == ["a line\n"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.fifo"]


def make_full_device(path) -> None:
    """A character device like /dev/full (1, 7) in a test's folder; skipped where not allowed."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("mknod is not allowed here (not root, or no CAP_MKNOD)")
    try:
        open(path, "wb").close()
    except OSError as e:
        pytest.skip(f"device nodes cannot be opened on this file system ({e.strerror})")


def test_a_device_is_written_in_place_and_a_full_one_fails(tmp_path):
    device = tmp_path / "full"
    make_full_device(device)
    with pytest.raises(OSError) as error:
        with files.atomic_write(device, "wb") as f:
            f.write(b"x" * 100)
            f.flush()
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(device)
    assert stat.S_ISCHR(os.lstat(device).st_mode) and os.listdir(tmp_path) == ["full"]


def test_a_folder_or_a_dangling_link_into_nowhere_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError, match="a folder, not a file"):
        with files.atomic_write(tmp_path):
            pass
    (tmp_path / "dangling").symlink_to(tmp_path / "missing" / "x")
    with pytest.raises(OSError, match="whose folder does not exist"):
        with files.atomic_write(tmp_path / "dangling"):
            pass
    assert not (tmp_path / "missing").exists()
    (tmp_path / "later").symlink_to(tmp_path / "made.txt")  # a dangling link into a folder: as a shell's >
    with files.atomic_write(tmp_path / "later") as f:
        f.write("x")
    assert (tmp_path / "made.txt").read_text() == "x" and (tmp_path / "later").is_symlink()


def test_a_link_to_an_export_is_replaced_through_and_a_file_there_refused(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "old.bin").write_bytes(b"old")
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "v1")
    with files.atomic_folder(link) as staged:
        (pathlib.Path(staged) / "new.bin").write_bytes(b"new")
    assert link.is_symlink() and os.listdir(tmp_path / "v1") == ["new.bin"]
    assert sorted(os.listdir(tmp_path)) == ["current", "v1"]
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        with files.atomic_folder(tmp_path / "a-file"):
            raise AssertionError("the block must not run")
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.parametrize("kind", ["link", "fifo", "device"])
def test_a_lock_is_never_followed_or_opened_as_anything_else(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    lock, precious = run / files.LOCK_NAME, tmp_path / "precious.txt"
    precious.write_text("a user's file\n")
    if kind == "link":
        lock.symlink_to(precious)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        make_full_device(lock)
    with pytest.raises(OSError, match="where a lock file goes"):
        with files.lock_folder(run):
            raise AssertionError("the block must not run")
    assert precious.read_text() == "a user's file\n"
    assert os.path.lexists(lock) and not lock.is_file() or lock.is_symlink()


def test_an_output_through_a_link_is_locked_beside_its_target_and_a_stream_not_at_all(tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "out.de"
    link.symlink_to(tmp_path / "real" / "out.de")
    with files.lock_output(link):
        assert (tmp_path / "real" / ".out.de.lock").exists()
        with pytest.raises(files.FileInUse):
            with files.lock_output(tmp_path / "real" / "out.de"):
                pass
    assert os.listdir(tmp_path / "real") == []  # the lock goes with its holder
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with files.lock_output(fifo):
        pass
    assert not (tmp_path / ".pipe.lock").exists()


def test_a_figure_is_saved_whole_and_closed(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = tmp_path / "line.png"
    files.save_figure(fig, path, dpi=50)
    assert path.read_bytes().startswith(b"\x89PNG") and os.listdir(tmp_path) == ["line.png"]
    assert not plt.fignum_exists(fig.number)


def test_a_reader_can_read_a_figure_only_with_its_colour_bars_and_axis_labels(tmp_path):
    """files.unreadable: a heat map needs a colour bar of its colours (one serves a grid of maps
    of one scale), an axis that shows tick labels needs a label (the figure's own serves all;
    a panel whose shared ticks are hidden needs none); save_figure(readable=True) refuses a
    figure with any such fault and writes nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def grid(bar: str = "", labels: bool = True):
        fig, axes = plt.subplots(1, 2, sharey=True)
        for k, ax in enumerate(axes):
            image = ax.imshow(np.eye(3), cmap="Blues", vmin=0, vmax=1)
            ax.set_title(f"head {k + 1}")
            if labels:
                ax.set_xlabel("key")
        axes[0].set_ylabel("query")
        if bar == "shared":
            fig.colorbar(image, ax=axes.tolist())
        elif bar == "other scale":
            fig.colorbar(axes[0].imshow(np.eye(3), cmap="Blues", vmin=0, vmax=2), ax=axes.tolist())
        return fig

    assert files.unreadable(grid("shared")) == []  # head 2 shares head 1's y ticks, hidden
    assert files.unreadable(grid()) == ["'head 1': a heat map without a colour bar",
                                        "'head 2': a heat map without a colour bar"]
    assert "'head 2': a heat map without a colour bar" in files.unreadable(grid("other scale"))
    unlabelled = grid("shared", labels=False)
    assert files.unreadable(unlabelled) == ["'head 1': the x axis has no label", "'head 2': the x axis has no label"]
    unlabelled.supxlabel("key")
    assert files.unreadable(unlabelled) == []

    fig, ax = plt.subplots()
    ax.axis("off")  # a diagram: no axis to label
    ax.text(0.5, 0.5, "box")
    assert files.unreadable(fig) == []
    plt.close("all")

    path = tmp_path / "maps.png"
    with pytest.raises(ValueError, match=r"maps\.png: 'head 1': a heat map without a colour bar"):
        files.save_figure(grid(), path, readable=True)
    assert not path.exists() and os.listdir(tmp_path) == []
    files.save_figure(grid("shared"), path, readable=True)
    assert path.read_bytes().startswith(b"\x89PNG")


# Translations as translate.py writes them: a chunk of lines at a time, flushed.
CHUNKS = ["".join(f"sentence {i}-{j}: ein Hund läuft durch das Gras\n" for j in range(7)) for i in range(400)]


def whole_lines_of(text: str) -> bool:
    """Whether ``text`` is the chunks' first lines, each whole."""
    return text.endswith("\n") and "".join(CHUNKS).startswith(text)


def test_a_partial_write_keeps_whole_lines_only(tmp_path):
    out = tmp_path / "out.de"
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_write(out, partial=f"{out}.partial") as f:
            f.write(CHUNKS[0] + "a line cut sh")  # as a write that fails part-way leaves it
            f.flush()
            raise KeyboardInterrupt
    assert (tmp_path / "out.de.partial").read_text() == CHUNKS[0]
    with pytest.raises(KeyboardInterrupt):  # not one whole line: nothing is kept
        with files.atomic_write(out, partial=f"{out}.partial2") as f:
            f.write("half a line")
            f.flush()
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.de.partial"]


def test_a_full_disk_mid_write_names_the_file_and_keeps_whole_lines(tmp_path):
    with tmpfs(tmp_path / "disk", "size=64k") as disk:
        out = disk / "out.de"
        with pytest.raises(OSError) as e:
            with files.atomic_write(out, partial=f"{out}.partial") as f:
                for chunk in CHUNKS:
                    f.write(chunk)
                    f.flush()
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(out)
        assert sorted(p.name for p in disk.iterdir()) == ["out.de.partial"]
        assert whole_lines_of((disk / "out.de.partial").read_text())
        fill(disk)  # and a lock's record, on a disk with no room left
        with pytest.raises(OSError) as e:
            with files.lock_output(disk / "other.de"):
                pass
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(disk / ".other.de.lock")


FILE_SIZE_LIMIT = """
import resource, sys
from minitransformer import cli, files

def main(argv):
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))  # ulimit -f
    with files.atomic_write(sys.argv[1], partial=sys.argv[1] + ".partial") as f:
        for chunk in sys.stdin:
            f.write(chunk[:-1].replace("|", "\\n"))
            f.flush()

cli.run(main, [])
"""


def test_a_file_size_limit_mid_write_ends_in_one_line_naming_the_file_and_keeps_whole_lines(tmp_path):
    out = tmp_path / "out.de"
    chunks = "".join(c.replace("\n", "|") + "\n" for c in CHUNKS)  # a chunk a line of stdin
    run = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, str(out)], input=chunks, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "MT_EMULATE_CUDA": "0"}, timeout=60)
    (line,) = run.stderr.splitlines()
    assert run.returncode == 1 and str(out) in line and "Traceback" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.de.partial"]
    partial = (tmp_path / "out.de.partial").read_text()
    assert whole_lines_of(partial) and len(partial.encode()) <= 20000


def lock_record(pid: int, host: str) -> str:
    return f"pid {pid} on {host} since 2026-01-02 03:04:05\n"


def test_what_ended_writers_left_is_removed_by_the_next_write_there_and_said_once(tmp_path, caplog):
    """Temporary files and output locks whose owner has ended on this host go; a lock that is
    held, another host's, a file of another content, and lock_folder's lock stay."""
    pid, start = ended_process()
    host = files._host()
    left = {f".tmp-out.de-@{host}:{pid}.{start}-k1ll3d": "Ein Hund", ".out.de.lock": lock_record(pid, host),
            ".empty.lock": lock_record(pid, host)}
    kept = {".held.lock": lock_record(os.getpid(), host), ".far.lock": lock_record(pid, "elsewhere"),
            ".users.lock": "not a record\n", ".lock": "", "out.de": "old"}
    for name, text in {**left, **kept}.items():
        (tmp_path / name).write_text(text)
    held = os.open(tmp_path / ".held.lock", os.O_RDONLY)
    try:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger="minitransformer.files"):
            with files.atomic_write(tmp_path / "new.de") as f:  # the first write of this process here
                f.write("Zwei Hunde\n")
            with files.atomic_write(tmp_path / "newer.de") as f:
                f.write("Drei Hunde\n")
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "new.de", "newer.de"])
    said = [r.getMessage() for r in caplog.records if "removed what ended runs left" in r.getMessage()]
    assert len(said) == 1 and all(name in said[0] for name in left)
    assert "a lock of host elsewhere" in caplog.text


def test_an_export_killed_between_its_two_renames_is_put_back(tmp_path):
    pid, start = ended_process()
    old = tmp_path / f".tmp-export-@{files._host()}:{pid}.{start}-k1_x-old"
    old.mkdir()
    (old / "model.bin").write_bytes(b"the earlier export")
    assert files.remove_unfinished_writes(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (tmp_path / "export" / "model.bin").read_bytes() == b"the earlier export"

"""minitransformer.files: a file is written whole or not at all, and a killed write's leftovers
are found and removed."""

import os
import stat

import pytest

from minitransformer import files


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


def test_remove_unfinished_writes_removes_only_the_temporary_files(tmp_path):
    (tmp_path / ".tmp-last.npz-abc123").write_bytes(b"half a checkpoint")
    (tmp_path / ".tmp-k1ll3d.npz").write_bytes(b"from an older version")
    for keep in ("last.npz", ".hidden", "tmp-not-ours"):
        (tmp_path / keep).write_bytes(b"x")
    assert files.remove_unfinished_writes(tmp_path) == [".tmp-k1ll3d.npz", ".tmp-last.npz-abc123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "last.npz", "tmp-not-ours"]
    assert files.remove_unfinished_writes(tmp_path) == []


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

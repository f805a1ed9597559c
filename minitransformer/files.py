"""Files written whole or not at all: checkpoints, tokenizers, logs, manifests and results.

``atomic_write`` writes into a temporary file ``.tmp-<name>-<random>`` in the target's folder,
fsyncs it, renames it over the target and fsyncs the folder: a crash at any moment leaves either
the previous file or the new one, never a torn mix (checkpoints, tokenizers, logs, manifests,
results). A crash can leave the temporary file itself behind; ``remove_unfinished_writes``
deletes those of a folder, as training does when it starts. A long write that is worth keeping
in part (translations, written as they are made) names a ``partial`` file: a failure leaves
what was written there, and the target untouched. ``atomic_folder`` does the same for a folder
of files (an export): filled beside its place, moved in only when it is complete.

``lock_folder`` makes a folder one process's for as long as it works in it (a training run's
``--out-dir``): a second process is refused, naming the first; ``lock_output`` does the same
for one file (a translation's ``--output``).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import socket
import tempfile
import time

PREFIX = ".tmp-"
LOCK_NAME = ".lock"


def _umask() -> int:
    """The process's umask (reading it means setting it: set it back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", partial: str | os.PathLike | None = None):
    """``with atomic_write(path, "wb") as f:`` a file object; ``path`` gets its content only if
    the block ends without an exception. The folder is created if missing. With ``partial``,
    an exception (an interrupt too) renames what was written so far to that path, if anything
    was, instead of deleting it."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a whole file: mode 'w' or 'wb', not {mode!r}")
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{PREFIX}{os.path.basename(path)}-", dir=folder)
    try:
        f = open(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        with f:
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if isinstance(e, OSError) and e.filename is None:
            e.filename = path  # a write that fails (a full disk) names no file of its own
        if os.path.exists(tmp):
            if partial is not None and os.path.getsize(tmp):
                os.replace(tmp, partial)
            else:
                os.unlink(tmp)
        raise
    folder_fd = os.open(folder, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(folder_fd)
    finally:
        os.close(folder_fd)


def save_figure(fig, path: str | os.PathLike, dpi: int = 100) -> None:
    """Write a pyplot figure to ``path`` as PNG, atomically (a reader never sees half a
    picture), and close it. Only a caller that drew one has imported matplotlib."""
    import matplotlib.pyplot as plt

    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    plt.close(fig)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike):
    """``with atomic_folder(path) as tmp:`` a new, empty folder beside ``path`` to fill; when the
    block ends without an exception it takes ``path``'s place (an earlier folder there is
    replaced as a whole), and otherwise (an interrupt too) it is deleted and ``path`` is as it
    was. The folder gets the usual permissions (0777 less the umask), as its subfolders do."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{PREFIX}{os.path.basename(path)}-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700 folders
        yield tmp
        if os.path.isdir(path):
            old = tmp + "-old"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_unfinished_writes(folder: str | os.PathLike) -> list[str]:
    """Delete the temporary files that a killed ``atomic_write`` left in ``folder`` (nothing
    reads them, and they would stay forever); returns their names."""
    stale = sorted(glob.glob(os.path.join(glob.escape(str(folder)), PREFIX + "*")))
    for path in stale:
        os.remove(path)
    return [os.path.basename(p) for p in stale]


class FolderInUse(RuntimeError):
    """The folder is held by another process's ``lock_folder``."""


class FileInUse(RuntimeError):
    """The file is held by another process's ``lock_output``."""


@contextlib.contextmanager
def lock_folder(folder: str | os.PathLike):
    """Hold ``folder`` (created if missing) for this process while the block runs.

    The lock is ``flock`` on the file ``.lock`` in it, which records the holder (pid, host,
    since when) for the message that refuses a second process: ``FolderInUse``. The kernel
    drops a flock when its process ends, however it ends (``kill -9`` too), so a lock is never
    stale; a record that a process which ended without releasing left behind (the file is
    emptied on release) is taken over, and returned by the block, for the caller to report.
    """
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_NAME)
    with _hold(path, lambda holder: FolderInUse(
            f"{folder} is in use by another run ({holder}, {path}): wait for it to end, or choose another folder")
               ) as left:
        yield left


@contextlib.contextmanager
def lock_output(path: str | os.PathLike):
    """Hold the file ``path`` for this process's writing while the block runs, as
    ``lock_folder`` holds a folder: a second writer of the same file is refused (``FileInUse``),
    a writer of another file of the folder is not. The lock is on ``.<name>.lock`` beside it
    (``path`` itself is replaced whole when it is written, and a lock on the file that was
    there would not hold the new one)."""
    path = os.path.abspath(path)
    lock = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{LOCK_NAME}")
    with _hold(lock, lambda holder: FileInUse(
            f"{path} is being written by another process ({holder}): wait for it to end, or write another file")):
        yield


@contextlib.contextmanager
def _hold(path: str, refusal):
    """flock ``path`` (created if missing), recording the holder in it; ``refusal(holder)`` is
    raised when another process holds it. Yields what a holder that ended without releasing
    left there, or None."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 1024).decode("utf-8", "replace").strip() or "a process"
            raise refusal(holder) from None
        left = os.read(fd, 1024).decode("utf-8", "replace").strip() or None
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        try:
            yield left
        finally:
            os.ftruncate(fd, 0)  # released: nothing left to take over
    finally:
        os.close(fd)  # drops the flock

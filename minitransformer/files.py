"""Files written whole or not at all: checkpoints, tokenizers, logs, manifests and results.

``atomic_write`` writes into a temporary file in the target's folder, fsyncs it, renames it over
the target and fsyncs the folder: a crash at any moment leaves either the previous file or the
new one, never a torn mix (checkpoints, tokenizers, logs, manifests, results). A long write
that is worth keeping in part (translations, written as they are made) names a ``partial``
file: a failure leaves what was written there, cut after its last complete line (a full disk
tears the line it was writing), and the target untouched. ``atomic_folder``
does the same for a folder of files (an export): filled beside its place, moved in only when it
is complete.

What they never touch. A path that is a symbolic link is written through, not replaced: a
link to a file has that file replaced (atomically, in its own folder) and the link kept; a path
that is (or leads to) something other than a regular file, a FIFO, a device or
``/proc/self/fd/1``, is written as a stream, in place, since nothing can be swapped for it
atomically. Nothing that is not a regular file or a folder is ever renamed over or deleted.

Temporary names carry their owner: ``.tmp-<name>-@<host>:<pid>.<start>-<random>``, the host,
the process and when it started (so that a later process given the same pid is not taken for
it). A crash (a kill -9, OpenBLAS aborting) can leave such a file or folder behind, and a
``lock_output`` lock file; ``remove_unfinished_writes`` deletes those of a folder whose owner
has ended on this host, and every process does it, saying so once (``clear_leftovers``), the
first time it writes into a folder. It never deletes another live process's (a translation
writing into a run's folder), another host's (it warns about them: the folder may be shared),
or a file not named so. Every OSError of these writes names its file (``naming``).

``lock_folder`` makes a folder one process's for as long as it works in it (a training run's
``--out-dir``): a second process is refused, naming the first; ``lock_output`` does the same
for one file (a translation's ``--output``) or folder. A lock file records its holder's pid and
host, and is opened only as a regular file, never through a link.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time

PREFIX = ".tmp-"
LOCK_NAME = ".lock"
# The owner in a temporary name (module docstring); mkstemp's random part has no "-".
_OWNED = re.compile(r"^\.tmp-(?P<name>.*)-@(?P<host>[^@:/]+):(?P<pid>\d+)(?:\.(?P<start>\d+))?-[a-z0-9_]+(?P<old>-old)?$")
_OUTPUT_LOCK = re.compile(r"^\..+\.lock$")  # lock_output's, beside the file it holds
_RECORD = re.compile(r"^pid (?P<pid>\d+) on (?P<host>\S+) since [\d-]+ [\d:]+\n?$")  # what _hold writes in it

log = logging.getLogger(__name__)


def _umask() -> int:
    """The process's umask (reading it means setting it: set it back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _process_start(pid: int | str) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/PID/stat, field 22), or
    None where there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()  # fields 3.. follow the name
    except (OSError, IndexError):
        return None


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def _temporary_prefix(path: str) -> str:
    """``.tmp-<name>-@<host>:<pid>.<start>-`` for a temporary file or folder beside ``path``
    (mkstemp adds the random part). The name is cut to keep the whole within NAME_MAX. The
    folder is noted for ``remove_own_temporaries`` before anything is made in it."""
    _writing_into(os.path.dirname(path))
    start = _process_start("self")
    owner = f"{_host()}:{os.getpid()}" + (f".{start}" if start else "")
    return f"{PREFIX}{os.path.basename(path)[:100]}-@{owner}-"


_temporary_folders: set[str] = set()  # where this process has made temporary files or folders


def _writing_into(folder: str) -> None:
    """Note ``folder`` as one this process writes into; the first time, clear what ended writers
    left there (``clear_leftovers``): the next run of any program cleans up after a killed one."""
    if folder not in _temporary_folders:
        _temporary_folders.add(folder)
        clear_leftovers(folder)


def remove_own_temporaries() -> None:
    """Delete the temporary files and folders of this process's unfinished writes.

    ``atomic_write`` and ``atomic_folder`` delete their own when interrupted, but an interrupt
    (Ctrl-C, SIGTERM) is raised at whatever line runs next, and some lines have no ``except``
    around them: inside ``mkstemp`` just after it made the file, or in ``__enter__`` just after
    the generator yielded, whose ``with`` block, and so its exit, never starts. ``cli.run`` calls
    this on an interrupt; rank 0 of several then ends by ``MPI_Abort``, which runs no finaliser."""
    mine = (_host(), str(os.getpid()), _process_start("self"))
    for folder in list(_temporary_folders):
        try:
            names = os.listdir(folder)
        except OSError:  # removed since
            continue
        for name in names:
            match = _OWNED.match(name)
            # "-old": the folder that atomic_folder was replacing, whole, kept.
            if match is None or match.group("host", "pid", "start") != mine or match["old"]:
                continue
            path = os.path.join(folder, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.isfile(path) and not os.path.islink(path):
                with contextlib.suppress(OSError):  # best effort: the interrupt's line comes next
                    os.remove(path)


def _owner_alive(pid: int, start: str | None) -> bool:
    """Whether the process of this host that named a temporary file still runs: the same pid
    and the same start time (a pid is reused), or where /proc is missing, the pid alone."""
    if start is not None and os.path.isdir("/proc/self"):
        return _process_start(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


@contextlib.contextmanager
def naming(path: str | os.PathLike):
    """An OSError raised in the block that names no file (a write or fsync that fails: a full
    disk, a file-size limit) is given ``path``, so that every error on a file says which
    (cli.os_error_line)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise


def _refuse(path: str, why: str, code: int = errno.EINVAL) -> OSError:
    """An OSError that the programs tell in one line: "why: path" (cli.os_error_line)."""
    return OSError(code, why, path)


def _resolve(path: str | os.PathLike) -> tuple[str, os.stat_result | None]:
    """Where writing ``path`` goes, and what is there now: a link is followed to its target
    (a dangling one to where it points, if that folder exists), a folder is refused. Returns
    the path to write and the stat of the object found (None: nothing there yet)."""
    path = os.path.abspath(path)
    try:
        st = os.stat(path)  # follows links, /proc/self/fd's too
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "a folder, not a file", path)
    if not os.path.islink(path):
        return path, st
    if st is not None and not stat.S_ISREG(st.st_mode):
        return path, st  # a stream: opened through the link itself (/proc/self/fd/1 has no real path)
    target = os.path.realpath(path)
    if st is None and not os.path.isdir(os.path.dirname(target)):
        raise _refuse(path, f"a symbolic link to {target}, whose folder does not exist", errno.ENOENT)
    return target, st


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", partial: str | os.PathLike | None = None):
    """``with atomic_write(path, "wb") as f:`` a file object; ``path`` gets its content only if
    the block ends without an exception. The folder is created if missing. With ``partial``,
    an exception (an interrupt too) renames what was written so far to that path, up to its
    last complete line, if there is one, instead of deleting it. A link is written through and a stream written in place
    (module docstring); a file replaced keeps its permissions, a new one gets the usual."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a whole file: mode 'w' or 'wb', not {mode!r}")
    given = os.path.abspath(path)
    path, st = _resolve(given)
    encoding = {} if "b" in mode else {"encoding": "utf-8"}
    if st is not None and not stat.S_ISREG(st.st_mode):  # a FIFO, a device: no swap is possible
        with naming(given), open(path, mode, **encoding) as f:
            yield f
        return
    folder = os.path.dirname(path)
    if path == given:  # a link's target folder is never created
        os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), dir=folder)
    try:
        f = open(fd, mode, **encoding)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        with f:
            os.chmod(tmp, stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask())  # mkstemp's is 0600
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if isinstance(e, OSError) and e.filename is None:
            e.filename = given  # a write that fails (a full disk) names no file of its own
        if os.path.exists(tmp):
            if partial is not None and _cut_to_whole_lines(tmp):
                os.replace(tmp, partial)
            else:
                os.unlink(tmp)
        raise
    folder_fd = os.open(folder, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(folder_fd)
    finally:
        os.close(folder_fd)


def _cut_to_whole_lines(path: str, block: int = 1 << 16) -> int:
    """Truncate ``path`` after its last newline, so that a write that failed part-way (a full
    disk, a file-size limit) leaves no torn line; returns the size kept. Shrinking a file needs
    no room, so this works on the disk that just filled."""
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:  # backwards, a block at a time: the last line is short, the file may not be
            start = max(end - block, 0)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        f.truncate(end)
    return end


def unreadable(fig) -> list[str]:
    """What a reader of ``fig`` could not read off it: each heat map (an image) whose colours no
    colour bar of the figure explains (one of the same colour map and limits will do, as one bar
    serves a grid of maps), and each axis whose tick labels are shown without a label (the
    figure's own x or y label, ``fig.supxlabel``, serves all; a panel that shares a neighbour's
    ticks and hides their labels needs none). Panels are named by their titles."""
    fig.draw_without_rendering()  # the tick labels' texts and visibility, as they will be drawn
    bars = [a._colorbar.mappable for a in fig.axes if getattr(a, "_colorbar", None) is not None]
    shared = {axis: getattr(fig, f"_sup{axis}label", None) is not None for axis in "xy"}
    problems = []
    for i, ax in enumerate(a for a in fig.axes if getattr(a, "_colorbar", None) is None):
        name = repr(ax.get_title() or f"panel {i + 1}")
        if not ax.axison:
            continue
        for image in ax.get_images():
            if not any(b.get_cmap().name == image.get_cmap().name and b.get_clim() == image.get_clim() for b in bars):
                problems.append(f"{name}: a heat map without a colour bar")
        for axis in "xy":
            shown = any(t.get_visible() and t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")())
            if getattr(ax, f"get_{axis}axis")().get_visible() and shown \
                    and not getattr(ax, f"get_{axis}label")() and not shared[axis]:
                problems.append(f"{name}: the {axis} axis has no label")
    return problems


def save_figure(fig, path: str | os.PathLike, dpi: int = 100, readable: bool = False) -> None:
    """Write a pyplot figure to ``path`` as PNG, atomically (a reader never sees half a
    picture), and close it. Only a caller that drew one has imported matplotlib.
    ``readable``: refuse (ValueError) a figure that ``unreadable`` finds fault with, before
    anything is written: the reading's pictures and the attention maps ask for it."""
    import matplotlib.pyplot as plt

    if readable and (problems := unreadable(fig)):
        plt.close(fig)
        raise ValueError(f"{os.fspath(path)}: {'; '.join(problems)}")
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    plt.close(fig)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike):
    """``with atomic_folder(path) as tmp:`` a new, empty folder beside ``path`` to fill; when the
    block ends without an exception it takes ``path``'s place (an earlier folder there is
    replaced as a whole), and otherwise (an interrupt too) it is deleted and ``path`` is as it
    was. A link to a folder has its target replaced and stays a link; a file, or anything else
    that is not a folder, at ``path`` is refused before the block runs. The folder gets the
    usual permissions (0777 less the umask), as its subfolders do."""
    given = os.path.abspath(path)
    path = os.path.realpath(given) if os.path.islink(given) else given
    if os.path.lexists(path) and not os.path.isdir(path):
        raise _refuse(given, "not a folder: an export replaces only a folder", errno.ENOTDIR)
    parent = os.path.dirname(path)
    if path == given:  # a link's target folder is never created
        os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=_temporary_prefix(path), dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700 folders
        with naming(given):  # a file written into it that fails unnamed (a full disk) is told as the folder's
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
    """Delete what ended writers left in ``folder``: the temporary files and folders named by a
    process of this host that no longer runs, and ``lock_output``'s lock files that nobody
    holds (nothing reads them, and they would stay forever); returns their names. The earlier
    folder that an ended ``atomic_folder`` was replacing is put back if nothing took its place.
    Another host's are kept, with a warning; a live process's, a link, and anything not named
    as these are named are not touched."""
    removed = []
    for name in sorted(os.listdir(folder)):
        owner = _OWNED.match(name)
        if owner is None:
            if _OUTPUT_LOCK.match(name) and _stale_lock(os.path.join(folder, name)):
                removed.append(name)
            continue
        path = os.path.join(folder, name)
        mode = os.lstat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            continue
        if owner["host"] != _host():
            log.warning("kept %s: an unfinished write of %s on host %s, which this host cannot tell "
                        "ended or not (delete it once it has)", path, owner["pid"], owner["host"])
            continue
        if _owner_alive(int(owner["pid"]), owner["start"]):
            continue
        original = os.path.join(folder, owner["name"])
        if owner["old"] and not os.path.lexists(original):  # killed between moving it aside and the new one in
            if len(owner["name"]) >= 100:  # the name may have been cut: where it goes is not known
                log.warning("kept %s: the folder an ended atomic_folder was replacing", path)
            else:
                os.rename(path, original)
                log.warning("put %s back from %s, where an ended atomic_folder left it", original, name)
            continue
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            os.remove(path)
        removed.append(name)
    return removed


def clear_leftovers(folder: str | os.PathLike) -> list[str]:
    """``remove_unfinished_writes``, said once in a warning when it removed anything; a folder
    that cannot be listed is left as it is."""
    try:
        removed = remove_unfinished_writes(folder)
    except OSError:
        return []
    if removed:
        log.warning("removed what ended runs left in %s: %s", folder, ", ".join(removed))
    return removed


def _stale_lock(path: str) -> bool:
    """Remove the lock file ``path`` if it is one of ours (its record is ``_hold``'s, of this
    host) and no process holds it; whether it did. Another host's is kept, with a warning:
    flock may not reach across hosts; a file of another record is not ours to touch."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # a link, gone since
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        record = _RECORD.match(os.read(fd, 1024).decode("utf-8", "replace"))
        if record is None:
            return False
        if record["host"] != _host():
            log.warning("kept %s: a lock of host %s, which this host cannot tell ended or not", path, record["host"])
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its writer runs
            return False
        os.unlink(path)  # a writer that opened it meanwhile sees it gone, and opens a new one (_hold)
        return True
    finally:
        os.close(fd)


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
    """Hold the file (or folder) ``path`` for this process's writing while the block runs, as
    ``lock_folder`` holds a folder: a second writer of the same one is refused (``FileInUse``),
    a writer of another of the folder is not. The lock is on ``.<name>.lock`` beside what is
    written (``path`` itself is replaced whole when it is written, and a lock on what was there
    would not hold the new one; through a link, beside its target), removed when the block ends,
    so that nothing is left beside it; one that an ended writer left is removed first
    (``clear_leftovers``). A stream (a FIFO, a device) takes no lock: nothing is made beside it."""
    if os.path.isdir(path):
        target = os.path.realpath(path)
    else:
        target, st = _resolve(path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            yield
            return
    _writing_into(os.path.dirname(target))
    lock = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}{LOCK_NAME}")
    with _hold(lock, lambda holder: FileInUse(
            f"{os.path.abspath(path)} is being written by another process ({holder}): wait for it to end, "
            f"or write another"), remove=True):
        yield


@contextlib.contextmanager
def _hold(path: str, refusal, remove: bool = False):
    """flock ``path`` (created if missing), recording the holder in it; ``refusal(holder)`` is
    raised when another process holds it. Yields what a holder that ended without releasing
    left there, or None. Only a regular file is a lock: a link there is not followed, and
    anything else (a FIFO, a device) is not opened, each refused in one line. ``remove``: the
    file is deleted on release, while still held; a process that opened it just before then
    holds a file no longer at ``path``, sees so, and tries again on the new one."""
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 1024).decode("utf-8", "replace").strip() or "a process"
            os.close(fd)
            raise refusal(holder) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        held = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # removed (or replaced) by its last holder between the open and the lock
    try:
        left = os.read(fd, 1024).decode("utf-8", "replace").strip() or None
        with naming(path):  # the record: a full disk fails here
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {_host()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        try:
            yield left
        finally:
            if remove:
                os.unlink(path)
            else:
                os.ftruncate(fd, 0)  # released: nothing left to take over
    finally:
        os.close(fd)  # drops the flock


def _open_lock(path: str) -> int:
    """The lock file at ``path`` opened for reading and writing, created if missing: only a
    regular file, never through a link (module docstring)."""
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        kind = "a symbolic link" if os.path.islink(path) else "not a regular file"
        raise _refuse(path, f"{kind} where a lock file goes (a lock is never followed or opened as "
                            f"anything else): remove it")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link made since the check
            raise _refuse(path, "a symbolic link where a lock file goes: remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(path, "not a regular file where a lock file goes: remove it")
    return fd

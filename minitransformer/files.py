"""Files written whole or not at all: checkpoints, tokenizers, logs, manifests and results.

``atomic_write`` writes into a temporary file ``.tmp-<name>-<random>`` in the target's folder,
fsyncs it, renames it over the target and fsyncs the folder: a crash at any moment leaves either
the previous file or the new one, never a torn mix (checkpoints, tokenizers, logs, manifests,
results). A crash can leave the temporary file itself behind; ``remove_unfinished_writes``
deletes those of a folder, as training does when it starts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile

PREFIX = ".tmp-"


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w"):
    """``with atomic_write(path, "wb") as f:`` a file object; ``path`` gets its content only if
    the block ends without an exception. The folder is created if missing."""
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
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the usual permissions
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    folder_fd = os.open(folder, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(folder_fd)
    finally:
        os.close(folder_fd)


def remove_unfinished_writes(folder: str | os.PathLike) -> list[str]:
    """Delete the temporary files that a killed ``atomic_write`` left in ``folder`` (nothing
    reads them, and they would stay forever); returns their names."""
    stale = sorted(glob.glob(os.path.join(glob.escape(str(folder)), PREFIX + "*")))
    for path in stale:
        os.remove(path)
    return [os.path.basename(p) for p in stale]

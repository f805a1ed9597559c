"""What the project's command-line programs share: options checked when they are parsed, and
ordinary failures told in one line.

Numeric options. ``integer(low, high)`` and ``real(low, high)`` are argparse ``type=``
functions that refuse, at parse time and naming the option, what the program cannot use:
``nan`` and ``inf`` for every real option, and any value outside [low, high] (``low_open``
makes the lower bound strict: a learning-rate factor must be above 0, a dropout may be 0).
Every option has both bounds, a range the code can compute with: a real option names its
largest value, an integer's is ``INT_MAX`` unless it names another (a seed's is 2**32 - 1).
The bounds stay on the function (``.low``, ``.high``...), so a test can read every program's
options and try each at 0, -1, nan and inf.

    p = cli.ArgumentParser(description=...)
    p.add_argument("--beam", type=cli.integer(1), help="beam size")
    p.add_argument("--alpha", type=cli.real(0.0, 10.0), help="length penalty")

Devices, inputs and outputs. ``device`` (for ``--device``) refuses a device that cannot be used
here, ``input_file`` / ``input_folder`` / ``data_folder`` a path that is not there to read, and
``output_file`` / ``output_folder`` a place that cannot be written, when the options are parsed:
before a program reads, computes or writes anything. Every option that names a path has one of
these types (a test walks every program's options). "-" is standard input or output where an
option takes a stream (``input_or_stdin``, ``output_or_stdout``: None, the option's default),
and is refused by the others, which would otherwise name a file "-".

``ArgumentParser`` is argparse's, with three changes: a bad option is one line (the program, the
option, what is wrong, and "see --help") instead of a page of usage; a boolean environment
variable that is neither on nor off (settings.env_flag) is refused in that same line; and the
help shows defaults. ``add_removed(flag, replacement)`` keeps a removed option known, so that a
command written for it stops in that same kind of line, naming what took its place, not a bare
"unrecognized arguments".

Ordinary failures. ``run(main, argv, ...)`` calls ``main`` and turns what a user meets in
normal use into one line on stderr and a non-zero status: an interrupt (Ctrl-C: status 130,
with the command that continues, when the program can say it; SIGTERM and SIGHUP alike, with
status 128 + the signal; one that came while the program loaded too, held by its first lines,
``PREAMBLE``), an ``OSError`` on a file (a full disk, a read-only folder, a missing one: the
file and the reason), sizes that do not fit in memory, a device that cannot be used, a setting
that cannot be used (``settings.SettingsError``), a file or folder in use by another process,
and the program's own ``user_errors`` (a bad corpus, a bad checkpoint). ``--debug`` (or
``MT_DEBUG=1``) lets the traceback through instead. Anything else is a bug, and keeps its
traceback. A reader of stdout that has gone (``... | head``) ends every program the same
way: quietly, with status 128 + SIGPIPE, as a pipe's writer killed by it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import select
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from minitransformer import backend, files, settings

DEBUG_ENV = "MT_DEBUG"
INTERRUPTED = 130  # the exit status of a program ended by Ctrl-C (128 + SIGINT), as shells give it
TERMINATING = (signal.SIGTERM, signal.SIGHUP)  # ended as Ctrl-C ends a program: Terminated
HELD = (signal.SIGINT, *TERMINATING)  # held by PREAMBLE while a program loads, until run
# Every program's first lines, before its imports (tests/test_cli.py checks each has them): a
# Ctrl-C (or SIGTERM, SIGHUP) while the imports load, up to a second, waits for ``run``, which
# ends the program with it in one line. (They cannot come from this module: importing it loads
# the whole package first.)
PREAMBLE = """if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
"""
# The largest integer option: every count the code computes with (NumPy's indices, steps,
# sizes) fits a C int, and 10**30 is refused when parsed, not an OverflowError later.
INT_MAX = 2**31 - 1


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in ``--help``, but not an unset one ("(default: None)") or a flag's False:
    their help says what not giving them means."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors and the defaults in ``--help``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _ShowDefaults)
        super().__init__(*args, **kwargs)
        self.removed: dict[str, str] = {}  # add_removed's: flag -> what took its place

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, after refusing a boolean environment variable that is neither on nor off
        (settings.check_environment): a setting too, refused before anything runs."""
        try:
            settings.check_environment()
        except settings.SettingsError as e:
            self.error(str(e))
        args, rest = super().parse_known_args(args, namespace)
        if getattr(args, "debug", None) is False:  # add_debug's
            args.debug = debug_from_env()
        return args, rest

    def add_removed(self, flag: str, replacement: str) -> None:
        """``flag`` is no longer an option: given (with or without a value), the program stops
        with status 2 and one line, "``flag`` was replaced by ``replacement``" (or "was removed:
        ..." when ``replacement`` starts with "removed"). Not shown in ``--help``."""
        why = replacement if replacement.startswith("removed") else f"replaced by {replacement}"
        parser, self.removed[flag] = self, replacement

        class Removed(argparse.Action):
            def __call__(self, *_):
                parser.error(f"{flag} was {why}")

        self.add_argument(flag, nargs="?", action=Removed, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def add_debug(self) -> None:
        """``--debug``: show the traceback of an ordinary failure (also ``MT_DEBUG=1``)."""
        self.add_argument("--debug", action="store_true",
                          help="show the traceback of an ordinary failure (an interrupt, a file that cannot "
                               f"be written, a bad corpus or checkpoint), which otherwise is one line; also "
                               f"{DEBUG_ENV}=1")


def debug_from_env() -> bool:
    """MT_DEBUG; a value that is neither on nor off counts as off here, and is refused in one
    line by the parser and by ``run``."""
    try:
        return settings.env_flag(DEBUG_ENV)
    except settings.SettingsError:
        return False


def _bounds(low, high, low_open: bool, high_open: bool) -> str:
    lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
    hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
    return " and ".join(s for s in (lo, hi) if s)


def _check(value, text: str, low, high, low_open: bool, high_open: bool, kind: str):
    below = low is not None and (value < low or (low_open and value == low))
    above = high is not None and (value > high or (high_open and value == high))
    if below or above:  # the value as the user wrote it
        raise argparse.ArgumentTypeError(f"{text.strip()}: must be {kind} {_bounds(low, high, low_open, high_open)}")
    return value


def integer(low: int | None = None, high: int = INT_MAX) -> Callable[[str], int]:
    """An argparse type for an integer in [low, high] (low None: unbounded below)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        return _check(value, text, low, high, False, False, "an integer")

    parse.kind, parse.low, parse.high, parse.low_open, parse.high_open = "integer", low, high, False, False
    parse.__name__ = "integer"
    return parse


def real(low: float | None = None, high: float | None = None, low_open: bool = False,
         high_open: bool = False) -> Callable[[str], float]:
    """An argparse type for a finite number in [low, high]; ``low_open``/``high_open`` leave
    out that end (a probability of dropping is in [0, 1): ``real(0, 1, high_open=True)``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number")
        return _check(value, text, low, high, low_open, high_open, "a number")

    parse.kind, parse.low, parse.high, parse.low_open, parse.high_open = "real", low, high, low_open, high_open
    parse.__name__ = "real"
    return parse


def comma_list(element):
    """An argparse type for comma-separated values, each read and checked by ``element`` (an
    ``integer`` or a ``real`` above), each kept once, in order. ``kind`` and ``element`` let a
    test find what every value must be."""

    def parse(text: str) -> list:
        try:
            values = [element(item.strip()) for item in text.split(",")]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (in {text!r})") from None
        return list(dict.fromkeys(values))

    parse.kind, parse.element = "list", element
    parse.__name__ = "list"
    return parse


def regex(text: str) -> re.Pattern:
    """An argparse type for a regular expression, compiled: a bad one (``(``) is a usage error
    naming what is wrong, not a traceback (argparse reads only ArgumentTypeError, TypeError and
    ValueError as one; ``re.error`` is none of them)."""
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {e}") from None


def device(text: str) -> str:
    """An argparse type for ``--device``: "cpu", or "cuda" where it can be used (CuPy and a GPU,
    or the emulated device), so that a program asked for a device it cannot have says so
    before it reads or writes anything."""
    try:
        return backend.check_device(text)
    except (ValueError, backend.DeviceUnavailable) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _not_a_stream(text: str) -> None:
    """Refuse "-", which Unix tools read as standard input or output: an option that takes a
    stream says so (``input_or_stdin``, ``output_or_stdout``); here it would name a file "-"."""
    if text == "-":
        raise argparse.ArgumentTypeError("'-' (standard input or output) is not taken here: give a path "
                                         "(./- for a file named -)")


def _writable(text: str, folder: bool) -> str:
    _not_a_stream(text)
    path = Path(text)
    kind = "folder" if folder else "file"
    if path.is_symlink() and not path.exists():
        raise argparse.ArgumentTypeError(f"{text} is a dangling symbolic link, not a {kind}")
    if path.exists() and folder and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    if path.exists() and not folder and path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not folder and path.exists() and not path.is_file():
        return text  # a FIFO, a device, /proc/self/fd/1: written as a stream (files.atomic_write)
    # Where the program will create files: the folder itself, or (a file is written beside its
    # place, then renamed: files.atomic_write) its folder, a link's target's; the nearest that exists.
    place = path.resolve() if path.is_symlink() else path.absolute()
    place = place if folder and path.exists() else place.parent
    while not place.exists() and not place.is_symlink():
        place = place.parent
    if not place.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text}: {place} is not a folder")
    try:  # the operating system's own answer (a read-only file system stops root too)
        tempfile.TemporaryFile(dir=place).close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {e.strerror or e}: {place}") from None
    return text


def output_file(text: str) -> str:
    """An argparse type for a file the program will write: refused when parsed if it cannot
    be, a folder, or inside something that is not a folder or not writable, so that no
    run computes for an hour before it finds out. The path is returned as given."""
    return _writable(text, folder=False)


def output_folder(text: str) -> str:
    """``output_file`` for a folder the program writes into (created if missing): a file or a
    dangling symbolic link there is refused as not a folder."""
    return _writable(text, folder=True)


def _readable(text: str, folder: bool, may_be_missing: bool = False) -> str:
    _not_a_stream(text)
    path = Path(text)
    kind = "folder" if folder else "file"
    if path.is_symlink() and not path.exists():
        raise argparse.ArgumentTypeError(f"{text} is a dangling symbolic link, not a {kind}")
    if not path.exists():
        if may_be_missing:
            return text
        raise argparse.ArgumentTypeError(f"{text}: no such {kind}")
    if folder and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    if not folder and path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not folder and path.is_socket():
        raise argparse.ArgumentTypeError(f"{text} is a socket, not a file")
    return text


def input_file(text: str) -> str:
    """An argparse type for a file the program reads: refused when parsed if it is missing, a
    folder, a dangling link or a socket. A link is followed; a FIFO or a device is read as a
    stream (``score.py <(gunzip -c hyp.gz) ref``); what the file holds is its loader's to check."""
    return _readable(text, folder=False)


def input_or_stdin(text: str) -> str | None:
    """``input_file``, or "-" for standard input: None, the option's default."""
    return None if text == "-" else input_file(text)


def output_or_stdout(text: str) -> str | None:
    """``output_file``, or "-" for standard output: None, the option's default."""
    return None if text == "-" else output_file(text)


def input_folder(text: str) -> str:
    """An argparse type for a folder the program reads (a run's): refused when parsed if it is
    missing, not a folder, or a dangling link; a link to a folder is followed."""
    return _readable(text, folder=True)


def data_folder(text: str) -> str:
    """``input_folder`` for a corpus folder, which may be missing: the program downloads the
    corpus into it (or says which files it lacks)."""
    return _readable(text, folder=True, may_be_missing=True)


def os_error_line(e: OSError) -> str:
    """One line for an OSError: its reason and the file it concerns. A full disk raises while
    the file is written and again while it is cleaned up; the first error with a file name in
    the chain is the one that says what happened."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.filename is not None:
            e = seen
            break
        seen = seen.__cause__ or seen.__context__
    reason = e.strerror or str(e)
    return f"{reason}: {e.filename}" if e.filename is not None else reason


def run(main: Callable, argv=None, *, debug: bool | None = None, user_errors: tuple = (),
        on_interrupt: Callable[[], str | bool | None] | None = None):
    """``main(argv)``, with ordinary failures told in one line (module docstring).

    ``debug``: let tracebacks through; None reads ``--debug`` in ``argv`` (or ``sys.argv``) and
    ``MT_DEBUG``. ``on_interrupt()`` may return what the user can do next (the command that
    resumes), added to the interrupt's line, or False to say nothing (one rank of several).
    """
    if debug is None:
        debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    debug = debug or debug_from_env()
    try:
        with _terminate_as_interrupt():
            settings.check_environment()  # for a program that parses no options
            result = main(argv)
            if sys.stdout is not None:
                sys.stdout.flush()  # here, so that a reader gone is found by the rule below, not at exit
            return result
    except (KeyboardInterrupt, OSError, MemoryError, backend.DeviceUnavailable, settings.SettingsError,
            files.FileInUse, files.FolderInUse, *user_errors) as e:
        if isinstance(e, BrokenPipeError) and _stdout_gone():
            # The reader of stdout has gone (... | head): end as a pipe's writer does, quietly,
            # with 128 + SIGPIPE; stdout is pointed at nothing so that its last flush at exit
            # does not fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(128 + signal.SIGPIPE) from None
        if debug:
            raise
        if isinstance(e, MemoryError):  # sizes the machine cannot hold (NumPy names them)
            raise SystemExit(f"error: out of memory{f': {e}' if str(e) else ''}") from None
        if not isinstance(e, KeyboardInterrupt):
            raise SystemExit(f"error: {os_error_line(e) if isinstance(e, OSError) else e}") from None
        files.remove_own_temporaries()  # what an interrupt left where atomic_write could not see it
        hint = on_interrupt() if on_interrupt is not None else None
        how = f"terminated ({e.name})" if isinstance(e, Terminated) else "\ninterrupted"  # past the terminal's ^C
        if hint is not False:  # False: another process (rank 0) tells it
            sys.stderr.write(how + (f": {hint}" if hint else "") + "\n")
        raise SystemExit(128 + e.signum if isinstance(e, Terminated) else INTERRUPTED) from None


def _stdout_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has closed it: poll says POLLERR."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # None, closed, or not a file (a test's capture)
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a scheduler's end of a job, a closed terminal), raised where the
    program is, as Ctrl-C's KeyboardInterrupt is, so that it gets the same cleanup: the same
    ``.partial``, the same last checkpoint, one line, and the status 128 + the signal."""

    def __init__(self, signum: int) -> None:
        self.signum, self.name = signum, signal.Signals(signum).name
        super().__init__(self.name)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """While the block runs, SIGTERM and SIGHUP raise ``Terminated`` (the first only: a second
    one would cut the cleanup short), unless the program was started ignoring them. Signal handlers belong to the main thread: elsewhere
    (a program run from a test's thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        for s in TERMINATING:
            signal.signal(s, signal.SIG_IGN)
        raise Terminated(signum)

    # A signal ignored when the program started (SIGHUP under nohup) stays ignored.
    before = {s: signal.signal(s, raise_terminated) for s in TERMINATING if signal.getsignal(s) == signal.SIG_DFL}
    try:
        # A program holds these from its first line while it loads (PREAMBLE): one that came
        # meanwhile is raised now, here, where it ends in one line.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)

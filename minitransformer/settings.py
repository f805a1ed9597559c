"""Settings a user gives, refused the same way wherever they are read.

``SettingsError`` is what a configuration class raises for a value it cannot use (a d_model
that the heads do not divide, a vocabulary too small, batches too small for a sentence): a
``ValueError`` of its own, so that the programs tell it in one line (``cli.run``) while a
``ValueError`` from a bug keeps its traceback. The programs check the settings they can before
any slow step (when parsed, or before a tokenizer is trained), by building those classes early.

``env_flag(name)`` reads a boolean environment variable, one rule for all of them: unset or
empty is the default; 1, true, yes, on are on and 0, false, no, off are off (any case, spaces
around ignored); anything else is a ``SettingsError`` naming the variable, never read as
either. (``MINITRANSFORMER_CUDA``, read by setup.py before the package exists, keeps its own
rule: anything but 0, false, no, off builds the kernels.) ``BOOLEAN_VARIABLES`` lists the
package's, which ``check_environment`` reads all at once (``cli.run`` does, first thing).

Nothing of the package is imported here: every layer may raise these.
"""

from __future__ import annotations

import os


class SettingsError(ValueError):
    """A setting (an option, a configuration field, an environment variable) that cannot be used;
    the message names it and says what it must be."""


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")

# The package's boolean environment variables, and what each turns on.
BOOLEAN_VARIABLES = {
    "MT_DEBUG": "the programs show the traceback of an ordinary failure",
    "MT_EMULATE_CUDA": 'device "cuda" is emulated on the CPU',
    "MINITRANSFORMER_KERNELS": "the compiled kernels are used where they can be (on by default)",
    "MT_REQUIRE_EMULATOR": "the emulator's tests fail, not skip, where it cannot run",
}


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (module docstring); ``default`` when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise SettingsError(f"{name}={value!r} is neither on ({', '.join(TRUE)}) nor off ({', '.join(FALSE)})")


def check_environment() -> None:
    """Refuse (SettingsError) a value that one of ``BOOLEAN_VARIABLES`` does not take."""
    for name in BOOLEAN_VARIABLES:
        env_flag(name)

"""Launching the multi-process tests: ``mpiexec -n 2 python mpi_worker.py ...``.

mpiexec is looked up next to this Python first (the ``mpich`` wheel installs it in
``<venv>/bin``, beside the mpi4py it must match), then on PATH. Without mpi4py or mpiexec the
multi-process tests are skipped with the reason; ``pip install -e '.[dev]'`` brings both.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("mpi_worker.py")
REPO = Path(__file__).resolve().parents[2]
# A rank waiting in MPICH polls without pause; with eight ranks on two cores the waiting ones
# would take the cores from the one being waited for. This makes a waiting rank sleep between
# polls (measured: a rank waiting 5 s used 2.0 s of CPU by default, 0.4 s with it).
YIELD = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def find_mpiexec() -> str | None:
    beside_python = Path(sys.prefix) / "bin" / "mpiexec"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("mpiexec")


@pytest.fixture(scope="session")
def worker():
    """The worker module itself, for the data and the model the reference needs."""
    spec = importlib.util.spec_from_file_location("mpi_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def mpiexec():
    """The mpiexec to launch ranks with; skips the test when MPI is not installed."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[dev]' or '.[mpi]')")
    path = find_mpiexec()
    if path is None:
        pytest.skip("no mpiexec next to this Python or on PATH (pip install mpich)")
    return path


@pytest.fixture(scope="session")
def mpirun(mpiexec):
    """``mpirun(scenario, out_dir, seed, *options, n=2, timeout=60)`` -> CompletedProcess."""

    def run(scenario, out_dir, seed, *options, n=2, timeout=60):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]), **YIELD)
        cmd = [mpiexec, "-n", str(n), sys.executable, str(WORKER), scenario, str(out_dir),
               str(seed), "--world-size", str(n), *map(str, options)]
        # A session of its own, so that a hung job can be killed whole: mpiexec and its ranks.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"mpiexec -n {n} {scenario} still running after {timeout} s (a hang)"
                        f":\n{out}\n{err}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    return run

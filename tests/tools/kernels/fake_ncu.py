"""A stand-in for Nsight Compute's `ncu`, for the tests of tools/kernels/ncu_counts.py and
gpu_check.sh's ncu stage on machines without a GPU: it takes the options ncu_counts.py passes,
runs the profiled command (on the emulated device, under the tests), and prints a table in the
layout of `ncu --csv --page raw --print-units base`: ncu's own ==PROF== lines, a header row, a
row of units, then a row for each launch. What it cannot know, the launches and their counts,
the test says through the environment:

    FAKE_NCU_KERNELS   the launches' kernel names, comma-separated (default: the -k regex's
                       alternatives, in order)
    FAKE_NCU_VALUES    JSON {metric: value} (default 0 for every metric asked)
    FAKE_NCU_REFUSE    metrics to refuse, comma-separated, as ncu refuses a name it does not know
    FAKE_NCU_SAY       a line to print on stderr, exiting 1 (ncu's permission error, say)
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

def install(folder: Path) -> Path:
    """An executable ``ncu`` in ``folder`` that runs this stand-in."""
    folder.mkdir(parents=True, exist_ok=True)
    ncu = folder / "ncu"
    ncu.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    ncu.chmod(0o755)
    return ncu


OPTIONS_WITH_VALUES = {"--page", "--print-units", "--print-metric-name", "--kernel-name-base", "-k", "--metrics"}


def main(argv: list[str]) -> int:
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in OPTIONS_WITH_VALUES:
            options[argv[i]], i = argv[i + 1], i + 2
        else:
            options[argv[i]], i = True, i + 1
    command = argv[i:]
    if os.environ.get("FAKE_NCU_SAY"):
        print(os.environ["FAKE_NCU_SAY"], file=sys.stderr)
        return 1
    metrics = options["--metrics"].split(",")
    refused = [m for m in os.environ.get("FAKE_NCU_REFUSE", "").split(",") if m in metrics]
    if refused:
        print(f"==ERROR== Failed to find metric {refused[0]}", file=sys.stderr)
        return 1
    print("==PROF== Connected to process 4242 (python)")
    done = subprocess.run(command)
    if done.returncode:
        return done.returncode
    print("==PROF== Disconnected from process 4242")
    pattern = options["-k"].removeprefix("regex:")
    kernels = os.environ.get("FAKE_NCU_KERNELS", pattern.replace("|", ",")).split(",")
    values = json.loads(os.environ.get("FAKE_NCU_VALUES", "{}"))
    fixed = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
             "Grid Size", "Device", "CC"]
    out = csv.writer(sys.stdout, quoting=csv.QUOTE_ALL, lineterminator="\n")
    out.writerow(fixed + metrics)
    out.writerow([""] * len(fixed) + ["sector" if "sectors" in m else "inst" for m in metrics])
    for n, kernel in enumerate(kernels):
        out.writerow([n, 4242, "python", "127.0.0.1", kernel, 1, 7, "(128, 1, 1)", "(2, 2, 1)", 0, 9.0]
                     + [f"{values.get(m, 0):,}" for m in metrics])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

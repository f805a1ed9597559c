"""examples/ablations.py under ``mpiexec -n 2``: each rank trains a row alone, and the table is
the one a single process writes (tests/examples/test_ablations.py has the toy sweep)."""

import json

import pytest

from tests.examples.test_ablations import sweep
from tests.helpers import needs_multi30k

pytestmark = pytest.mark.slow  # a whole sweep under mpiexec

# Measured per run, not a property of the row: left out of the comparison.
TIMINGS = ("train_minutes", "steps_per_s", "rank")


@needs_multi30k
def test_two_ranks_write_the_table_of_one_process(mpiexec, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    sweep(one)
    ranks = sweep(two, mpiexec, "-n", "2")
    assert (two / "table.md").read_text() == (one / "table.md").read_text()
    rows = {n: json.loads((d / "table.json").read_text())["rows"] for n, d in (("one", one), ("two", two))}
    assert [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows["two"]] == \
           [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows["one"]]
    assert sorted(r["rank"] for r in rows["two"]) == [0, 1]  # a row on each rank
    assert ranks.stdout.count("| base |") == 1  # the table, printed by rank 0 alone

"""Test-session plumbing: the order pytest-xdist hands out test files, and measurements a test
reports.

* Order: `make test` runs the files on two pytest-xdist workers, one file per worker at a time
  (`--dist loadfile --no-loadscope-reorder`), in the order collected here. The longest files
  (whole studies under both drivers, benchmarks, the calibration runs) take a minute or more each
  and go first, the longest first, so that the many short files fill in at the end instead of one
  long file running alone on one core.
* Measurements: `measured(line)` records a line of what a test measured (an error rate, a
  throughput); the lines are printed at the end of the run, also from xdist workers, whose own
  output pytest does not show.
"""
from __future__ import annotations

import os

import pytest

# The tests run dvc many times; after each command DVC starts a process that imports DVC
# again to send a usage report (about 1.5 s of CPU each). The test copies are not the user's
# projects, so no report is sent from them.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

# Seconds per file on two workers (sums of its tests' phases in a CI run on a 2-core Intel Xeon, with
# the AVX2 kernels and the reference checks beside them; PIPELINE_TEST_TIMES re-measures them; a
# file marked slow and not listed counts 30), for the order only: a wrong or missing figure changes
# how well the two workers are balanced, never what is tested.
SLOW_FILE_SECONDS = {
    "test_rerun.py": 176, "test_adaptive.py": 134, "test_node.py": 123, "test_views.py": 118,
    "test_bench.py": 115, "test_dvc_studies.py": 112, "test_calibration.py": 99, "test_dag.py": 96,
    "test_preload.py": 36,
}


def pytest_collection_modifyitems(items):
    weight: dict[str, float] = {}  # per file, so that a file's tests stay together
    for item in items:
        name = item.path.name
        guess = SLOW_FILE_SECONDS.get(name, 30.0 if item.get_closest_marker("slow") else 0.0)
        weight[name] = max(weight.get(name, 0.0), guess)
    items.sort(key=lambda item: -weight[item.path.name])  # stable: a file's tests keep their order


def pytest_runtest_logreport(report):
    """PIPELINE_TEST_TIMES=FILE: appends "test-file<TAB>phase<TAB>seconds" for every test phase, so that
    SLOW_FILE_SECONDS can be re-measured (the sums per file). Written once, by the process that
    collects the workers' reports."""
    path = os.environ.get("PIPELINE_TEST_TIMES")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"{report.nodeid.split('::')[0]}\t{report.when}\t{report.duration:.2f}\n")


@pytest.fixture
def measured(record_property):
    """measured(line): prints `line` in the run's summary (record_property carries it from a worker)."""
    return lambda line: record_property("measured", line)


def pytest_terminal_summary(terminalreporter):
    lines = [value for outcome in ("passed", "failed") for rep in terminalreporter.stats.get(outcome, [])
             if rep.when == "call" for name, value in rep.user_properties if name == "measured"]
    if lines:
        terminalreporter.section("measured")
        for line in lines:
            terminalreporter.write_line(line)

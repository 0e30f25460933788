"""A pytest plugin that appends each test's CPU seconds (its process's, and its finished subprocesses') and
wall seconds to $CPUTIME_OUT as tab-separated lines: where the suite's time goes, independent of how loaded
the machine is (docs/measuring.md#the-test-suite).

    CPUTIME_OUT=/tmp/cpu.tsv PYTHONPATH=benchmarks python -m pytest -q -n auto -p cputime_plugin
"""

import os
import resource
import time

import pytest


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.perf_counter()
    yield
    with open(os.environ.get("CPUTIME_OUT", "cputime.tsv"), "a") as f:
        f.write(f"{item.nodeid}\t{_cpu() - cpu:.3f}\t{time.perf_counter() - wall:.3f}\n")

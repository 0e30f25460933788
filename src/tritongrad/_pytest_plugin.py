"""A pytest plugin, loaded wherever tritongrad is installed (its ``pytest11`` entry point): it registers the
``extended`` marker that ``OpSuite.pytest`` puts on the kit's cases beyond the quick tier, so that a project
using the kit needs no marker declaration of its own (``--strict-markers`` included)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "extended: the second tier: checks the quick tier already makes, on more samples, shapes or "
        "specializations (tritongrad.testing.OpSuite); pytest -m extended runs them, -m 'not extended' leaves them out")

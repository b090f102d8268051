"""One optimize run of zoo:bert shared by the report tests (the report of a run, rendered
as markdown, HTML and in a browser). Both files that use it are in one xdist group, so
that the run is made once per session, not once per file."""

import pytest

from opswap.config import OptimizeConfig
from opswap.models import load
from opswap.pipeline import optimize


@pytest.fixture(scope="session")
def bert_result():
    m = load("zoo:bert")
    return optimize(
        m.module, m.example_inputs, OptimizeConfig(samples=2, compare="none"), name="zoo:bert"
    )

"""The ONNX tests' small-graph builder, for the CLI's ONNX commands."""

import pytest
from tests.onnx.conftest import Graphs


@pytest.fixture
def graphs(tmp_path) -> Graphs:
    return Graphs(tmp_path)

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    # Small ops on 2 threads stall for a whole scheduler slice whenever another process
    # holds a core (15 ms for a 0.1 ms conv); these tests measure no speed, so use one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

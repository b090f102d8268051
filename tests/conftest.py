import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Run a test on one intra-op thread. Small ops on 2 threads stall for a whole
    scheduler slice whenever another process holds a core (15 ms for a 0.1 ms conv);
    tests that measure no speed gain nothing from the second thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

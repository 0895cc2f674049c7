import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Codec tests run on one torch thread (timings and results independent of the machine's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

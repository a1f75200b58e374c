import pytest
import torch


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run fastest on one thread; real-model tests get the machine's cores."""
    before = torch.get_num_threads()
    if request.node.get_closest_marker("real_model") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

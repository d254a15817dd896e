import pytest


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is fastest, and several spin badly on a shared 2-core machine."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

import pytest

from harness import Clusters


@pytest.fixture(scope="session")
def clusters():
    """``clusters(W)`` is a live gloo cluster of W ranks, shared by the whole session."""
    c = Clusters()
    yield c
    c.close()

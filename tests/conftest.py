import pytest

from harness import Clusters

_WORST = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def clusters():
    """``clusters(W)`` is a live gloo cluster of W ranks, shared by the whole session."""
    c = Clusters()
    yield c
    c.close()


@pytest.fixture
def worst_errors(request):
    """A dict ``{(dtype, tensor): (err, tol)}`` of the worst errors seen, for the summary."""
    return request.config.stash.setdefault(_WORST, {})


def pytest_terminal_summary(terminalreporter, config):
    worst = config.stash.get(_WORST, {})
    if worst:
        terminalreporter.section("worst relative errors, all ranks (attention: vs float64; "
                                 "HF model, Trainer: vs the same model in one process)")
        for (dtype, name), (err, tol) in sorted(worst.items()):
            terminalreporter.write_line(f"{dtype:9s} {name:4s} {err:.2e}  (bound {tol:.2e})")


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank (spawning, or joining a group) fails the test."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def started(*args, **kwargs):
        raise AssertionError("a rank was started before the arguments were checked")

    monkeypatch.setattr(mp, "spawn", started)
    monkeypatch.setattr(dist, "init_process_group", started)
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)

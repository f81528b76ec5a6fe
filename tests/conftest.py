import os

import pytest
import torch

# Tests run on the CPU with two threads (the machine's cores); Triton kernels run in the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seeded_env(tmp_path, monkeypatch):
    """A seeded SQLite hotel in tmp_path as the process's store (CHORUS_DATA_DIR); the worker's shared engine
    and store are closed afterwards."""
    import datetime as dt

    from agent import worker
    from tools.seed import seed
    from tools.store import open_store

    monkeypatch.setenv("CHORUS_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with open_store() as store:
        seed(store, dt.date.today())
    yield tmp_path
    worker.close_shared()

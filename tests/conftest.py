import os

import pytest
import torch

from engine.process.malloc import tune_malloc

# Tests run on the CPU with two threads (the machine's cores); without a CUDA device Triton kernels run in the
# interpreter. The interpreter is chosen when a kernel is decorated, for the whole process: on a CUDA host the
# files that interpret kernels on CPU tensors (test_kernels, test_decode_attention) switch it on themselves,
# so the CUDA tests of the others run in a process of their own (scripts/gpu_check.sh: one pytest per file).
# The allocator is the engine's (engine/process/malloc.py), for the tests that drive the stages without an
# engine too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))
tune_malloc()
# scripts/livekit.sh's start_livekit exports the server for a worker; tests name their server explicitly
# (CHORUS_TEST_LIVEKIT_*), so no test picks it up by accident
for _name in ("LIVEKIT_URL", "LIVEKIT_API_KEY", "LIVEKIT_API_SECRET"):
    os.environ.pop(_name, None)


# files whose CUDA tests call the kernels in this process (the others compile them in a child, run_compiled)
COMPILED_ONLY = {"test_graph.py", "test_slack_graphs.py"}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") == "1":  # a file of interpreted kernels was imported first
            interpreted = pytest.mark.skip(
                reason="the Triton interpreter is on in this process; run the CUDA tests of this file alone "
                "(scripts/gpu_check.sh does)"
            )
            for item in items:
                if item.get_closest_marker("gpu") is not None and item.fspath.basename in COMPILED_ONLY:
                    item.add_marker(interpreted)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id that says "gpu"
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


@pytest.fixture
def sqlite_hotel(tmp_path, monkeypatch):
    """The hotel the agent books in: a seeded SQLite store in tmp_path (also
    the process's CHORUS_DATA_DIR)."""
    from hotel_support import hotel, seeded_store

    monkeypatch.setenv("CHORUS_DATA_DIR", str(tmp_path))
    with seeded_store("sqlite", tmp_path) as store:
        yield hotel(store)


@pytest.fixture
def livekit(monkeypatch):
    """A protocol fake of LiveKit's server API (tests/twirp_fake.py) as the process's LIVEKIT_URL, with its
    key and secret, and CHORUS_FRONT_DESK_NUMBER set to FRONT_DESK."""
    from twirp_fake import FRONT_DESK, KEY, SECRET, LiveKitFake

    fake = LiveKitFake()
    url, server = fake.serve()
    monkeypatch.setenv("LIVEKIT_URL", url)
    monkeypatch.setenv("LIVEKIT_API_KEY", KEY)
    monkeypatch.setenv("LIVEKIT_API_SECRET", SECRET)
    monkeypatch.setenv("CHORUS_FRONT_DESK_NUMBER", FRONT_DESK)
    yield fake
    server.shutdown()
    server.server_close()


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    """A seeded SQLite hotel in tmp_path, as `python -m tools seed` leaves it, for a worker started as a
    subprocess (CHORUS_DATA_DIR points at it)."""
    import datetime as dt

    from tools.seed import seed
    from tools.store import open_store

    monkeypatch.setenv("CHORUS_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with open_store() as store:
        seed(store, dt.date.today())
    return tmp_path


@pytest.fixture(scope="module")
def cases(request):
    """A model stage's frozen reference cases: `cases.safetensors` in the test module's FIXTURES folder."""
    from safetensors.torch import load_file

    return load_file(str(request.module.FIXTURES / "cases.safetensors"))

import contextlib
import os

import pytest
import torch

from engine.process.malloc import tune_malloc

# Tests run on the CPU with two threads (the machine's cores; shared among xdist's workers, pytest_configure);
# without a CUDA device Triton kernels run in the interpreter. The interpreter is chosen when a kernel is
# decorated, for the whole process: on a CUDA host the files that interpret kernels on CPU tensors
# (test_kernels, test_decode_attention) switch it on themselves, so the CUDA tests of the others run in a
# process of their own (scripts/gpu_check.sh: one pytest per file). The allocator is the engine's
# (engine/process/malloc.py), for the tests that drive the stages without an engine too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
tune_malloc()
# scripts/livekit.sh's start_livekit exports the server for a worker; tests name their server explicitly
# (CHORUS_TEST_LIVEKIT_*), so no test picks it up by accident
for _name in ("LIVEKIT_URL", "LIVEKIT_API_KEY", "LIVEKIT_API_SECRET"):
    os.environ.pop(_name, None)


# files whose CUDA tests call the kernels in this process (the others compile them in a child, run_compiled)
COMPILED_ONLY = {"test_graph.py", "test_slack_graphs.py"}

# `make test` runs the suite on two xdist workers (-n 2 --dist loadgroup). The tests that share a service
# started outside pytest (the LiveKit server and its Redis, Jaeger, PostgreSQL: .ci/run starts them) or that
# keep time on the wall clock go in one xdist group: one worker runs them one after another, as a run without
# xdist does, while the other runs the rest beside them. A test is in it when it is marked `livekit` or
# `serial`, when its module reaches the LiveKit server (it imports livekit_support's require_livekit), or when
# it runs on PostgreSQL (a "postgres" parameter, hotel_support.BACKENDS).
SERIAL = "serial"


def pytest_configure(config):
    """The machine's cores (two at most, as CI's) shared among xdist's workers: one thread each on 2 cores."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))


def in_group(config, items) -> None:
    """xdist's loadgroup finds a test's group at the end of its id ("<id>@serial"), which xdist 3.8 writes to
    the node's `_nodeid`; pytest 9.2 keeps the id in `_id`, so the group is written there. Nothing to do where
    the id has it already, or without loadgroup."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        group = item.get_closest_marker("xdist_group")
        if group is not None and not item.nodeid.endswith(f"@{group.args[0]}"):
            item._id = NodeId.parse(f"{item.nodeid}@{group.args[0]}")


# the longest of the group, which hold a call's silences to seconds: last in the group, so that they run when
# the other worker has run out of tests and the machine is theirs
LAST = ("tests/test_livekit_fleet.py::test_a_rolling_restart", "tests/test_soak.py::")
AHEAD_NICE, BESIDE_NICE = 0, 10  # the group's tests ahead of the rest on the CPU


def pytest_runtest_setup(item):
    """On an xdist worker the group's tests (and the workers, engines and rooms they start, which inherit it)
    run at the usual priority, the others beside them at a lower one: the rest only has the CPU where the
    group's calls leave it. Raising a priority back needs the privilege CI runs with; without it the rest
    keeps the lower one for the run, which is still what the group needs."""
    if not hasattr(item.config, "workerinput"):
        return
    nice = AHEAD_NICE if item.get_closest_marker("xdist_group") is not None else BESIDE_NICE
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def one_after_another(item) -> bool:
    """Whether `item` goes in the SERIAL group (above)."""
    if item.get_closest_marker("livekit") is not None or item.get_closest_marker(SERIAL) is not None:
        return True
    if hasattr(getattr(item, "module", None), "require_livekit"):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(isinstance(v, str) and v == "postgres" for v in params.values())


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group from the marker
def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        serial = pytest.mark.xdist_group(SERIAL)
        for item in items:
            if one_after_another(item):
                item.add_marker(serial)
    items.sort(key=lambda item: item.nodeid.startswith(LAST))  # stable: the rest keeps its order
    in_group(config, items)
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

"""Tests run single-threaded in the pytest process: on a shared 2-core box, two intra-op
threads competing with other processes make every op wait for the slower thread. Tests marked
``gpu`` are skipped where no CUDA device is present. Multi-rank Lightning cases share one
launch per world size (``worlds``, :mod:`tests._worlds`), cases on gloo without Lightning one
set of processes per size (``gloo``, :mod:`tests._gloo`).

``make test`` runs :mod:`tests.suite`: the ``launch`` lane (the shared Lightning worlds and the
tests marked ``launch``: recipes, torchrun nodes, elastic restarts, failing ranks) with the
``rest`` lane beside it at idle priority (everything else, the gloo worlds included; its
``quiet`` tests after the launch lane's end, and last the ``serial`` tests, which time
processes against each other, each alone)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests import _machine
from tests._gloo import GlooWorlds
from tests._worlds import Worlds, collect_cases
from tests.suite import LANE_VARIABLE

_WORLD_CASES = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def worlds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Worlds:
    """The shared Lightning worlds (:mod:`tests._worlds`) of the selected tests' cases.

    Under :mod:`tests.suite` only the launch lane may launch them: a test of another lane that
    reached them would launch every world a second time beside the launch lane's."""
    lane = os.environ.get(LANE_VARIABLE)
    if lane not in (None, "launch"):
        pytest.fail(f"this test reads the shared Lightning worlds in the suite's {lane!r} "
                    "lane: name the `worlds` fixture in the test's (or its fixture's) "
                    "arguments, so that pytest_itemcollected marks it `launch`", pytrace=False)
    return Worlds(tmp_path_factory.mktemp("worlds"), request.config.stash[_WORLD_CASES])


@pytest.fixture(scope="session")
def gloo() -> Iterator[GlooWorlds]:
    """Long-lived gloo worlds for runtime cases without Lightning (:mod:`tests._gloo`)."""
    worlds = GlooWorlds()
    yield worlds
    worlds.close()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config: pytest.Config) -> None:
    """Under :mod:`tests.suite`'s side-by-side shards, whatever starts a process first takes
    the machine for its test (:mod:`tests._machine`)."""
    _machine.configure()
    if not _machine.active():
        return
    import multiprocessing.process
    import subprocess

    def exclusive(start):
        def wrapped(self, *args, **kwargs):
            _machine.need_the_machine()
            return start(self, *args, **kwargs)
        return wrapped

    subprocess.Popen.__init__ = exclusive(subprocess.Popen.__init__)
    multiprocessing.process.BaseProcess.start = exclusive(multiprocessing.process.BaseProcess.start)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _machine.begin_test(beside=item.get_closest_marker("one_child") is not None,
                        ranks=item.get_closest_marker("quiet") is None
                        and item.get_closest_marker("ranks") is not None)
    try:
        yield
    finally:
        _machine.end_test()


def pytest_itemcollected(item: pytest.Item) -> None:
    """The shared Lightning worlds run in :mod:`tests.suite`'s launch lane; the gloo worlds'
    ranks beside it at idle priority (``ranks``, :mod:`tests._machine`)."""
    fixtures = getattr(item, "fixturenames", ())
    if "worlds" in fixtures:
        item.add_marker(pytest.mark.launch)
    if "gloo" in fixtures:
        item.add_marker(pytest.mark.ranks)


@pytest.hookimpl(trylast=True)  # after ``-m``/``-k`` deselection: only what runs here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The shared worlds hold the cases of the selected tests' modules only (a lane or a
    ``-k`` selection launches what it reads, not every module's cases); no CUDA: skip ``gpu``."""
    modules = {id(item.module): item.module for item in items if getattr(item, "module", None)}
    config.stash[_WORLD_CASES] = collect_cases(modules.values())
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)



def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """Under :mod:`tests.suite`'s side-by-side shards every shard collects the whole lane and
    runs the test files it claims first (:func:`tests._machine.claim`), one file at a time:
    the shards end together however long each file takes. They take the files with a
    ``ranks`` test first, then those of single-process tests: beside the launch lane a ranks
    test's idle-priority ranks use what the launch leaves idle, and the single-process files
    fill the rest and, left for the end, run two at a time on an otherwise idle machine
    (single-process files first filled the whole launch phase here and left every ranks test
    for after it, one at a time: in two runs back to back the suite's time after the launch
    lane's end fell from 119 s at 1.1-1.8 busy cores to 78 s, 2 busy cores until the serial
    tests); a file's ``quiet`` tests wait for the launch lane's end (its other tests do not),
    and the ``serial`` tests come after every other (each starts ranks and so holds the
    machine alone, :func:`tests._machine.need_the_machine`)."""
    if not _machine.active() or session.config.option.collectonly:
        return None
    files: dict[str, list[pytest.Item]] = {}
    for item in session.items:
        # a file's ``quiet`` and ``serial`` tests are units of their own: its other tests
        # need not wait with them
        path = item.nodeid.split("::")[0]
        late = next((m for m in ("serial", "quiet") if item.get_closest_marker(m)), None)
        files.setdefault(f"{path}::{late}" if late else path, []).append(item)

    def marked(name: str) -> set[str]:
        return {path for path, items in files.items()
                if any(item.get_closest_marker(name) is not None for item in items)}

    serial, ranks = marked("serial"), marked("ranks")
    quiet = marked("quiet") | serial
    # the ranks files, then the single-process files, the quiet ones, the serial ones
    order = {path: 3 if path in serial else 2 if path in quiet else 0 if path in ranks else 1
             for path in files}

    def claimed_next(wait: bool) -> list[pytest.Item]:
        """The next file this shard claims; none while only ``quiet`` files are left and the
        launch lane runs, unless ``wait``: then after its end."""
        while files:
            path = min(files, key=order.__getitem__)
            if path in quiet and _machine.beside_the_launch():
                if not wait:
                    return []
                _machine.await_the_launch()
            items = files.pop(path)
            if _machine.claim(path):
                return items
        return []

    queue = claimed_next(wait=True)
    while queue:
        item = queue.pop(0)
        if not queue:  # the next file is claimed as this one's last test starts
            queue = claimed_next(wait=False)
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=queue[0] if queue else None)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        if not queue:
            queue = claimed_next(wait=True)
    return True


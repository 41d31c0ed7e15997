"""Suite-wide hooks: every engine core a test made ends each test idle (`engine_cores_end_idle`); the long
compiler jobs of tests/model/test_isa_builds.py start in the background, at the lowest CPU priority, as soon as
collection shows they will run (tests/model/isa_jobs.py says why), and their tests run last."""

from __future__ import annotations

import time
import weakref

import pytest

from tests.model import isa_jobs

_cores: weakref.WeakSet = weakref.WeakSet()  # every EngineCore built in this process and still alive


def pytest_configure(config: pytest.Config) -> None:
    from tokenmill.engine.core import EngineCore

    built = EngineCore.__init__

    def init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        _cores.add(self)

    EngineCore.__init__ = init


@pytest.fixture(autouse=True)
def engine_cores_end_idle():
    """After every test, each engine core still alive in this process (the test's, or a module's shared one) has
    whatever it still runs aborted, and then must hold nothing: no block, no lock in the prefix cache, no
    per-request state of speculation, structured output or KV transfer (EngineCore.check_idle_invariants). A
    leak anywhere in a request's life fails the test that caused it."""
    yield
    for core in list(_cores):
        core.abort_all()
        deadline = time.monotonic() + 5.0
        while core.has_unfinished and time.monotonic() < deadline:  # a producer's transfers report their outcome
            core.step()
        core.check_idle_invariants()


def _isa_check(item: pytest.Item) -> bool:
    return item.path.name == "test_isa_builds.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ISA checks run last: their background jobs then have the whole suite's idle CPU to finish in (from the
    middle of the run, the first of them waited 42 s for its build)."""
    items[:] = [i for i in items if not _isa_check(i)] + [i for i in items if _isa_check(i)]


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    wanted = set()
    for item in session.items:
        if _isa_check(item):
            target = getattr(item, "callspec", None) and item.callspec.params.get("target")
            wanted.add(f"build:{target}" if target else isa_jobs.AMX_SYNTAX)
    isa_jobs.start([job for job in isa_jobs.background_jobs() if job in wanted])


def pytest_sessionfinish(session: pytest.Session) -> None:
    isa_jobs.stop_all()  # jobs no test waited for (a -k or -x run): not left compiling

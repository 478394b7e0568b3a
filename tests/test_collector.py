"""The engine loop keeps Python's cyclic collector off what lives as long as the engine
(runtime/collector.py): a loaded engine's objects are frozen out of every later collection,
closing thaws them, and an engine dropped without close() is still freed."""
from __future__ import annotations

import gc
import weakref

from kiln.runtime.engine_core import EngineCore

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)


def test_a_loaded_engine_is_out_of_the_collectors_walk_until_closed(engine_dir):
    core = EngineCore(engine_dir, device="cpu")
    try:
        frozen = gc.get_freeze_count()
        # What a full collection walks now: what was made after the engine loaded, a few objects.
        assert frozen > 10_000 and len(gc.get_objects()) < frozen // 20
        core.add_request("r0", [1, 2, 3], greedy(4))
        while core.has_work():
            core.step()
    finally:
        core.close()
    assert gc.get_freeze_count() == 0


def test_an_engine_dropped_without_close_is_freed_when_the_next_loads(engine_dir):
    core = EngineCore(engine_dir, device="cpu")
    executor = weakref.ref(core.executor)
    core = None  # its loop holds itself in reference cycles: only the collector frees it
    other = EngineCore(engine_dir, device="cpu")
    try:
        assert executor() is None
    finally:
        other.close()

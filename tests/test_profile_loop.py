"""scripts/profile_loop.py's reading of a profiled step, on made-up timelines: the idle time between plan
kernels and how far each kernel's end moved the step on, where programmatic launches overlap."""
from __future__ import annotations

from scripts.profile_loop import plan_advance, plan_gaps, timeline

PLAN = {"qkv", "attention", "o_proj"}


def event(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "ts": ts, "dur": dur}


def test_ends_count_what_each_kernel_added_after_the_one_before():
    # attention starts (is launched) during qkv and waits for it: only its end past qkv's counts.
    step = [event("Memcpy HtoD", 0.0, 1.0), event("qkv", 2.0, 10.0), event("attention", 5.0, 12.0),
            event("o_proj", 20.0, 5.0)]
    assert plan_advance(step, PLAN) == {"qkv": 10.0, "attention": 5.0, "o_proj": 8.0}
    # The plan kernels' span, from the first one's start, is what the ends add up to.
    assert sum(plan_advance(step, PLAN).values()) == 25.0 - 2.0
    assert plan_gaps(step, PLAN) == (3.0, 2)


def test_a_kernel_that_ends_inside_an_earlier_one_adds_nothing():
    step = [event("qkv", 0.0, 10.0), event("attention", 1.0, 4.0), event("o_proj", 2.0, 12.0),
            event("o_proj", 20.0, 1.0)]
    assert plan_advance(step, PLAN) == {"qkv": 10.0, "attention": 0.0, "o_proj": 4.0 + 7.0}


def test_the_timeline_lists_each_launch_from_the_first_start():
    # In start order, as the profiler's events come: an o_proj launch that ends inside qkv moves nothing on.
    step = [event("Memcpy HtoD", 0.0, 1.0), event("qkv", 2.0, 10.0), event("o_proj", 3.0, 1.0),
            event("attention", 5.0, 12.0), event("o_proj", 20.0, 5.0)]
    assert timeline(step, PLAN) == [(0.0, 10.0, 10.0, "qkv"), (1.0, 2.0, 0.0, "o_proj"), (3.0, 15.0, 5.0, "attention"),
                                    (18.0, 23.0, 8.0, "o_proj")]

"""The server's collector clock: collections counted and timed per generation while installed."""

from __future__ import annotations

import gc

from dspark.server.gc_pauses import GCPauses


def test_a_forced_collection_counts_under_generation_2_with_its_time():
    pauses = GCPauses()
    pauses.install()
    try:
        gc.collect()
    finally:
        pauses.uninstall()
    assert pauses.counts[2] >= 1
    assert pauses.seconds[2] > 0.0
    assert pauses.summary().startswith("gc: ")
    assert "gen2 " in pauses.summary()


def test_after_uninstall_nothing_more_is_counted():
    pauses = GCPauses()
    pauses.install()
    pauses.install()  # (once, however often)
    pauses.uninstall()
    assert pauses._callback not in gc.callbacks
    gc.collect()
    assert not pauses.counts and not pauses.seconds


def test_take_hands_over_the_counts_and_starts_again():
    pauses = GCPauses()
    pauses.install()
    try:
        gc.collect()
        taken = pauses.take()
        assert not pauses.counts and not pauses.seconds
    finally:
        pauses.uninstall()
    assert taken.counts[2] >= 1 and taken.seconds[2] > 0.0
    assert GCPauses().summary() == "gc: 0 collections, 0.00 ms in all"


def test_the_summary_lists_each_generation():
    pauses = GCPauses()
    pauses.counts.update({0: 10, 1: 1, 2: 1})
    pauses.seconds.update({0: 0.0002, 1: 0.0003, 2: 0.00291})
    assert pauses.summary() == (
        "gc: 12 collections, 3.41 ms in all (gen0 10 / 0.20 ms, gen1 1 / 0.30 ms, gen2 1 / 2.91 ms)"
    )

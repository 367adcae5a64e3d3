"""The cyclic collector while a step loop runs (dspark/engine/collector.py): the heap frozen and
young collections rarer for the loop's length, both restored after it."""

import gc

import pytest

from dspark import LLM, SamplingParams
from dspark.engine.collector import STEP_LOOP_THRESHOLDS, steady_collector


@pytest.fixture
def default_collector():
    """Each test starts with an unfrozen heap and the default thresholds (a served loop's READY
    earlier in this process froze it and raised them), and ends with the thresholds it found."""
    thresholds = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_the_loop_runs_frozen_with_rarer_young_collections(default_collector):
    thresholds = gc.get_threshold()
    with steady_collector():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == STEP_LOOP_THRESHOLDS
        young = [object()]  # made inside the loop: tracked, not frozen
        assert gc.is_tracked(young) and any(o is young for o in gc.get_objects())
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == thresholds


def test_a_heap_frozen_already_and_raised_thresholds_are_left_alone(default_collector):
    gc.freeze()
    frozen = gc.get_freeze_count()
    gc.set_threshold(50_000, 20, 20)
    with steady_collector():
        assert gc.get_threshold() == (50_000, 20, 20)
    # not unfrozen by a loop that did not freeze it (unfrozen, the count is 0; frozen objects
    # that die meanwhile, such as this test's temporaries, lower it a little)
    assert gc.get_freeze_count() > frozen // 2 > 0
    assert gc.get_threshold() == (50_000, 20, 20)


def test_restored_when_the_loop_raises(default_collector):
    thresholds = gc.get_threshold()
    with pytest.raises(RuntimeError), steady_collector():
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == thresholds


def test_generate_steps_frozen_and_restores_the_collector(default_collector, tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=4)
    seen = []
    step = llm.engine.step

    def observed_step():
        seen.append((gc.get_freeze_count() > 0, gc.get_threshold()))
        return step()

    llm.engine.step = observed_step
    out = llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4, 4]
    assert seen and all(s == (True, STEP_LOOP_THRESHOLDS) for s in seen)
    assert gc.get_freeze_count() == 0  # what the loop made is the collector's again

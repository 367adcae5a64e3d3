"""The memory plan's sampler reserve: per sampled position, so a speculative engine reserves
for the K + 1 positions each row verifies (the sampled verify at the largest batch)."""

from __future__ import annotations

from pathlib import Path

import dspark.drafters
from dspark.config import EngineConfig
from dspark.engine.memory import GRAPH_POOL_BUFFERS, SAMPLER_BUFFERS, sampler_bytes
from dspark.engine.spec_setup import verified_positions


def test_the_sampler_reserve_counts_every_verified_position():
    config = EngineConfig(model="default", max_num_seqs=512)
    plain = sampler_bytes(config, 49_152)
    assert plain == SAMPLER_BUFFERS * 512 * 49_152 * 4
    assert sampler_bytes(config, 49_152, positions_per_row=8) == 8 * plain
    assert sampler_bytes(config, 49_152, 8) == 4.5 * 2**30  # the docstring's example


def test_speculative_graphs_reserve_their_pool_too():
    config = EngineConfig(model="default", max_num_seqs=256)
    eager = sampler_bytes(config, 49_152, 8)
    graphs = sampler_bytes(config, 49_152, 8, spec_graphs=True)
    assert graphs == eager * (SAMPLER_BUFFERS + GRAPH_POOL_BUFFERS) / SAMPLER_BUFFERS
    assert graphs == 7.125 * 2**30  # the docstring's example
    # the pool's 3.96 GiB measured on the H100 at this size with five graphs a size, and a
    # sixth graph's share (the mixed step's TEMPERATURE mode), fit the extra reserve
    assert graphs - eager > 3.96 * 6 / 5 * 2**30
    # a second tail size ("mixed_prefill_tokens": [256, 512]): three mixed graphs a size more
    two_tails = sampler_bytes(config, 49_152, 8, spec_graphs=True, num_tails=2)
    assert two_tails == eager * (SAMPLER_BUFFERS + GRAPH_POOL_BUFFERS + 6) / SAMPLER_BUFFERS
    assert round(two_tails / 2**30, 2) == 9.38  # the docstring's example
    assert sampler_bytes(config, 49_152, 8, num_tails=2) == eager  # (no graphs: no pool)


def test_verified_positions_come_from_the_drafter_block():
    shipped = Path(dspark.drafters.__file__).parent / "smollm2_135m_instruct"
    assert verified_positions(shipped) == 7 + 1
    assert verified_positions(None) == 1

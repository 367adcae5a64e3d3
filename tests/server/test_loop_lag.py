import asyncio
import time

from dspark.server.loop_lag import LoopLag


def test_a_blocked_loop_shows_as_lag():
    async def main() -> LoopLag:
        lag = LoopLag(period_s=0.002)
        lag.start()
        await asyncio.sleep(0.02)
        time.sleep(0.05)  # the loop is held: the sleeping task wakes ~50 ms late
        await asyncio.sleep(0.02)
        lag.stop()
        return lag.take()

    taken = asyncio.run(main())
    assert len(taken.samples) >= 3
    assert max(taken.samples) >= 0.04
    assert sorted(taken.samples)[len(taken.samples) // 2] < 0.04  # most wake-ups are on time
    assert "max" in taken.summary()


def test_take_starts_again():
    lag = LoopLag()
    lag.samples = [0.001, 0.002]
    taken = lag.take()
    assert taken.samples == [0.001, 0.002] and lag.samples == []
    assert lag.summary() == "loop lag: no samples"


def test_restart_leaves_the_stall_before_it_out():
    async def main() -> tuple[LoopLag, LoopLag]:
        lag = LoopLag(period_s=0.002)
        lag.start()
        await asyncio.sleep(0.02)
        time.sleep(0.2)  # start-up work holds the loop; the wake-up due meanwhile is dropped
        before = lag.restart()
        await asyncio.sleep(0.02)
        lag.stop()
        return before, lag.take()

    before, after = asyncio.run(main())
    # (neither shows the 200 ms stall)
    assert before.samples and max(before.samples) < 0.15
    assert after.samples and max(after.samples) < 0.15

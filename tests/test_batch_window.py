"""The pooling scheduler's batching window, on virtual time."""

from __future__ import annotations

import asyncio

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import PoolingParams


async def make(wait: float, max_num_seqs: int = 8):
    clock = ManualClock()
    enc = FakeEngine(num_blocks=256, block_size=16)
    enc.batch_config = lambda: BatchConfig(max_num_seqs=max_num_seqs, max_prefill_chunk=4096)
    rt = Runtime(FakeEngine(), config=SchedulerConfig(step_in_thread=False, pool_batch_wait_s=wait),
                 clock=clock, pooling_engines={"embed": enc})
    await rt.start()
    return rt, enc, clock


async def test_an_idle_encoder_waits_for_its_window_then_steps_once_with_everything():
    rt, enc, clock = await make(0.005)
    first = rt.pool([1, 2, 3], PoolingParams(), target="embed")
    await rt.quiesce()                          # exact: an open window waits for the clock
    assert enc.steps == 0                       # the window is open
    rest = [rt.pool([4, i], PoolingParams(), target="embed") for i in range(5, 8)]
    await rt.quiesce()
    assert enc.steps == 0
    clock.advance(0.005)
    for h in [first, *rest]:
        assert (await h.stream.final()).finish_reason == "stop"
    assert enc.history[0] == [(h.rid, n) for h, n in zip([first, *rest], (3, 2, 2, 2))]
    await rt.quiesce()
    await rt.shutdown()


async def test_no_wait_for_probes_or_a_full_batch_or_a_zero_window():
    rt, enc, clock = await make(0.005, max_num_seqs=2)
    hs = [rt.pool([i], PoolingParams(), target="embed") for i in range(1, 3)]   # a full batch
    for h in hs:
        await h.stream.final()
    probe = rt.pool([9], PoolingParams(), target="embed", is_probe=True)
    await probe.stream.final()
    assert enc.steps == 2 and clock.now() == 0.0
    await rt.quiesce()
    await rt.shutdown()
    rt, enc, clock = await make(0.0)
    await rt.pool([1], PoolingParams(), target="embed").stream.final()
    assert enc.steps == 1
    await rt.shutdown()


async def test_shutdown_with_an_open_window_does_not_hang():
    rt, enc, clock = await make(0.005)
    h = rt.pool([1, 2], PoolingParams(), target="embed")
    await rt.quiesce()
    assert enc.steps == 0
    await asyncio.wait_for(rt.shutdown(), 5)
    assert (await h.stream.final()).finish_reason == "abort"

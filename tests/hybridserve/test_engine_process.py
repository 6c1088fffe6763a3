"""EngineProcess: the engine in a child process behind the front AsyncEngine has (the server's
default). The built-in model, fp32; one engine process for most tests."""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from hybridserve.async_engine import AsyncEngine, EngineError
from hybridserve.config import EngineConfig
from hybridserve.engine import Engine
from hybridserve.engine_process import EngineProcess
from hybridserve.host import ThreadGovernor, process_cpu
from hybridserve.sampling import SamplingParams

PROFILE = {"c0": 0.01, "c_tok": 1e-4, "c_serial": 1e-3, "c_dec": 1e-3}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["def f(x):", "import os\n", [104, 105, 32, 116, 104, 101, 114, 101]]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile") / "cost.json"
    profile.write_text(json.dumps(PROFILE))
    return EngineConfig.from_settings(dtype="float32", cost_profile=str(profile), memory_gb=0.1, max_running=8,
                                      max_model_len=256)


@pytest.fixture(scope="module")
def proc(config):
    ep = EngineProcess(config, threads=1)
    yield ep
    ep.shutdown()
    assert not ep.alive and not multiprocessing.active_children()


def run(coro):
    return asyncio.run(coro)


async def collect(front, prompt, params=GREEDY):
    return [o async for o in await front.add(prompt, params)]


async def wait_idle(front) -> None:
    while await asyncio.wrap_future(front.submit(Engine.has_unfinished)):
        await asyncio.sleep(0.01)


def test_the_engine_process_serves_what_the_thread_engine_serves(proc, config):
    """The same greedy requests through both fronts, at once: identical tokens and text; the
    deltas cross the pipe without the prompt, the last output carries it; nothing is held after."""
    async def both(front):
        return await asyncio.gather(*(collect(front, p) for p in PROMPTS))

    thread = AsyncEngine.build(lambda: Engine(config), threads=1)
    try:
        ours, ref = run(both(proc)), run(both(thread))
    finally:
        thread.shutdown()
    for outs, want in zip(ours, ref):
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in want]
        assert (outs[-1].token_ids, outs[-1].text, outs[-1].finish_reason) == (want[-1].token_ids, want[-1].text,
                                                                               "length")
        assert all(o.prompt_token_ids == [] for o in outs[:-1]) and outs[-1].prompt_token_ids
    assert outs[-1].prompt_token_ids == PROMPTS[-1]
    assert set(proc.submit(Engine.audit).result(30).values()) == {0}
    assert proc.stats["running"] == 0 and proc.info.model_name == "builtin"


def test_bad_input_is_refused_and_the_engine_goes_on(proc):
    """A request the engine cannot serve raises its ValueError at add() (across the pipe) and
    the next request is served; so is a call's exception."""
    with pytest.raises(ValueError, match="exceeds the model's context of 256 tokens"):
        run(collect(proc, [1] * 250, GREEDY))
    assert len(run(collect(proc, "ok"))[-1].token_ids) == GREEDY.max_tokens
    with pytest.raises(TypeError, match="has no len"):
        proc.submit(len).result(30)  # len(engine) raises in the engine process


def test_closing_a_stream_aborts_its_request_and_frees_it(proc):
    """A reader that stops after two outputs aborts its request in the engine process: once
    idle, the audit finds nothing held."""
    async def go():
        stream = await proc.add("abc", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        seen = [await stream.__anext__(), await stream.__anext__()]
        stream.close()
        await wait_idle(proc)
        return seen

    assert not any(o.finished for o in run(go()))
    assert set(proc.submit(Engine.audit).result(30).values()) == {0}


def test_a_dead_engine_process_fails_its_requests(config):
    """Killing the engine process mid-request: the stream raises EngineError, `alive` turns
    False and new requests are refused with "shutting_down"."""
    ep = EngineProcess(config, threads=1)

    async def go():
        stream = await ep.add("abc", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        ep._proc.kill()
        with pytest.raises(EngineError):
            async for _ in stream:
                pass
        with pytest.raises(EngineError) as refused:
            await ep.add("abc", GREEDY)
        return refused.value.code

    assert run(go()) == "shutting_down"
    assert not ep.alive
    ep.shutdown()


def test_shutdown_fails_unfinished_streams_and_ends_the_process(config):
    """shutdown() with a request running: its reader gets EngineError "shutting_down" and the
    engine process exits by itself (exit status 0)."""
    ep = EngineProcess(config, threads=1)

    async def go():
        stream = await ep.add("abc", SamplingParams(temperature=0, max_tokens=250, ignore_eos=True))
        await stream.__anext__()
        await asyncio.to_thread(ep.shutdown)
        with pytest.raises(EngineError) as err:
            async for _ in stream:
                pass
        return err.value.code

    assert run(go()) == "shutting_down"
    assert ep._proc.exitcode == 0 and not ep.alive


def test_a_model_that_does_not_load_raises_in_the_front(tmp_path):
    """The engine's construction error reaches the caller, and no process is left behind."""
    before = set(multiprocessing.active_children())
    with pytest.raises(Exception, match="config.json|No such file|does not exist|not a directory"):
        EngineProcess(EngineConfig.from_settings(model=str(tmp_path / "missing")))
    assert set(multiprocessing.active_children()) == before


def test_the_governor_counts_a_partner_process_cpu_as_its_own():
    """With the server front as a partner, the front's CPU time is not other processes'
    contention: own_cpu() adds it (read from /proc/<pid>/stat)."""
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while process_cpu(busy.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        gov = ThreadGovernor(2, lambda n: None, partners=(busy.pid,))
        partner, own = process_cpu(busy.pid), sum(os.times()[:2])
        assert partner >= 0.25
        assert gov.own_cpu() == pytest.approx(own + partner, abs=0.05)
    finally:
        busy.kill()
        busy.wait()
    assert process_cpu(busy.pid) == 0.0  # ended: nothing to count

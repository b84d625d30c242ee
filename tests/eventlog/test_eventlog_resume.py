"""Appending to a log (``record --append``) records nothing twice.

Real publishers (with replay sockets) and a real subscriber on ipc. Each recording joins
the way every subscriber does, by asking for a replay from seq 0, so the second and third
recordings are offered everything the log already holds. The log must replay into the
engine's true cache: no block counted twice, no phantom restart, a real restart marked.
"""

from __future__ import annotations

import anyio
import pytest

from kvstream.eventlog import LogMessage, LogWriter, read_log
from kvstream.eventlog.recorder import Recorder
from kvstream.eventlog.summary import LogSummary
from kvstream.transport import Publisher, SourceSpec, Subscriber
from tests.eventlog.test_eventlog_record_replay import TOPIC, _cfg, _Engine


@pytest.fixture
def short_tmp(tmp_path_factory):
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvres") as d:
        yield d


async def _record(log_path, spec, expect_batches):
    """One `record --append`-style session that stops after the subscriber yielded
    ``expect_batches`` batches (everything the publisher buffers: its join replay)."""
    with LogWriter(log_path, resume=True) as writer:
        async with Subscriber([spec], topic=TOPIC, replay_timeout_s=1.0, backoff_s=0.02) as sub:
            rec = Recorder(sub, writer)
            with anyio.fail_after(60):
                await rec.run(max_batches=expect_batches)
    return rec


def _publish(pub, engine, n):
    for _ in range(n):
        pub.publish(engine.step(0.0))


async def _scenario(tmp):
    log_path = f"{tmp}/resumed.kvlog"
    cfg = _cfg(tmp, "e0")
    spec = SourceSpec(cfg.endpoint, cfg.replay_endpoint, "e0")
    engine = _Engine(1)
    async with Publisher(cfg) as pub:
        _publish(pub, engine, 40)
        first = await _record(log_path, spec, 40)
        _publish(pub, engine, 25)
        second = await _record(log_path, spec, 65)  # offered 0..64, of which 0..39 are in the log
    same_engine = (list(read_log(log_path)[0]), set(engine.cached))
    restarted = _Engine(2)  # a new engine instance on the same endpoints: seqs from 0 again
    async with Publisher(cfg) as pub:
        _publish(pub, restarted, 30)
        third = await _record(log_path, spec, 30)
    return first, second, third, same_engine, set(restarted.cached)


def _summary(records):
    s = LogSummary()
    for r in records:
        s.add(r)
    return s.sources["e0"]


def test_appended_recordings_skip_what_the_log_holds_and_mark_a_real_restart(short_tmp):
    first, second, third, (after_second, truth_second), truth_third = anyio.run(_scenario, short_tmp)
    assert first.resume is None and second.resume.skipped == 40 and second.resume.restarts == 0

    seqs = [r.seq for r in after_second if isinstance(r, LogMessage)]
    assert seqs == list(range(65))  # each seq once
    s = _summary(after_second)
    assert s.restarts == 0 and s.gaps == []
    assert s.cached == len(truth_second)  # every block counted once

    assert third.resume.restarts == 1 and third.resume.skipped == 0
    records, damage = read_log(f"{short_tmp}/resumed.kvlog")
    assert damage == []
    s = _summary(records)
    assert s.restarts == 1 and s.resets == {"restart": 1}
    assert s.cached == len(truth_third)  # the old instance's blocks were dropped at the reset

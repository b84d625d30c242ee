"""The sans-IO parts: subject tokens, URLs, what a relay publishes, what a consumer yields."""

from __future__ import annotations

import pytest

from kvstream.wire.events import KVEventBatch, decode_batch, encode_batch
from kvstream.jetstream import JetStreamConfigError, RelaySource, StreamSettings, StreamSource, parse_nats_url
from kvstream.jetstream import wire
from kvstream.transport import SourceBatch, SourceLive, SourceReset, SourceStale


def _b(source: str, seq: int, ts: float, replayed: bool = False) -> SourceBatch:
    batch = KVEventBatch(ts, [])
    return SourceBatch(source, seq, b"kv@e0", encode_batch(batch), batch, replayed)


def test_subject_tokens_round_trip_any_source_name() -> None:
    for name in ("e0", "tcp://10.0.0.1:5557", "a.b*c>d e%f", "ünï"):
        tok = wire.subject_token(name)
        assert not set(tok) & set(".*> ") and wire.source_from_token(tok) == name


def test_nats_urls_parse_with_defaults_and_reject_bad_input_with_the_syntax() -> None:
    s = parse_nats_url("nats://h:4222")
    assert (s.url, s.stream, s.subject_prefix, s.sources) == ("nats://h:4222", "KV_EVENTS", "kv", ())
    s = parse_nats_url("nats://h/EV?source=e0&source=e1&prefix=fleet.kv")
    assert (s.url, s.stream, s.subject_prefix, s.sources) == ("nats://h:4222", "EV", "fleet.kv", ("e0", "e1"))
    for bad in ("tcp://h:1", "nats://h:4222/a/b", "nats://h:x", "nats://h?bogus=1", "nats://h/bad.name"):
        with pytest.raises(JetStreamConfigError, match="nats://HOST|stream name|prefix"):
            parse_nats_url(bad)
    with pytest.raises(JetStreamConfigError, match="replicas"):
        StreamSettings(replicas=7)


def test_relay_publishes_batches_unchanged_with_seq_instance_and_message_id() -> None:
    r = RelaySource("e0")
    b = _b("e0", 0, 1.0)
    [(payload, h)] = r.on_item(b)
    assert payload is b.payload
    assert h[wire.H_MSG_ID] == "e0:0:0" and h[wire.H_SEQ] == "0" and h[wire.H_INSTANCE] == "0"
    assert wire.decode_topic(h[wire.H_TOPIC]) == b"kv@e0"
    # an engine restart: a new instance, announced once, when the engine's first batch
    # confirms it (other bytes at a seq the stream has)
    assert r.on_item(SourceReset("e0", "restart", 0)) == []
    [(ctl, hc), (_, h)] = r.on_item(_b("e0", 0, 2.0))
    assert hc[wire.H_KIND] == "reset" and hc[wire.H_INSTANCE] == "1"
    assert wire.decode_control("e0", ctl) == SourceReset("e0", "restart", 0)
    assert h[wire.H_MSG_ID] == "e0:1:0"
    assert r.on_item(_b("e0", 1, 2.1))[0][1][wire.H_MSG_ID] == "e0:1:1"


def test_a_restart_only_one_relay_believes_is_not_published_until_the_engine_confirms_it() -> None:
    # A relay cut from the engine past its buffer marks a gap (forgetting the bytes it
    # could check the engine with) and, reconnected, its subscriber cannot tell the engine
    # from a new one: a "restart". The engine goes on where it was: same instance, a gap.
    r = RelaySource("e0")
    for s in range(20):
        r.on_item(_b("e0", s, 1.0 + s / 100))
    [(ctl, _)] = r.on_item(SourceStale("e0", "buffer", 20, 60))
    assert r.on_item(SourceReset("e0", "restart", 60)) == []
    # Its join then lost what follows: the stream must not look exact until a batch
    # decides, so the state is said to be unverified from pos + 1 (a consumer that the
    # other relay of the engine already took beyond it reads it as covered).
    [(p, hs)] = r.on_item(SourceStale("e0", "join", 0, 50))
    assert wire.decode_control("e0", p) == SourceStale("e0", "join", 60, 60) and hs[wire.H_INSTANCE] == "0"
    assert [r.on_item(_b("e0", s, 2.0 + s / 100)) for s in range(50, 60)] == [[]] * 10  # in the gap: undecided
    [(_, h)] = r.on_item(_b("e0", 60, 2.6))
    assert h[wire.H_MSG_ID] == "e0:0:60"
    # an idle new engine: its newest seq is below what the stream has
    r = RelaySource("e0")
    for s in range(5):
        r.on_item(_b("e0", s, 1.0))
    assert r.on_item(SourceReset("e0", "restart", 5)) == []
    msgs = r.on_item(SourceLive("e0", -1))
    assert [wire.decode_control("e0", p) for p, _ in msgs] == [SourceReset("e0", "restart", 0), SourceLive("e0", -1)]
    assert msgs[0][1][wire.H_INSTANCE] == "1"


def test_a_joining_relay_skips_what_the_stream_holds_and_detects_a_restart_by_time() -> None:
    known = wire.StreamPosition(instance=3, pos=5, ts=10.0)
    r = RelaySource("e0", known)
    assert r.on_item(SourceStale("e0", "join", 0, 2)) == []  # the stream has those
    assert [r.on_item(_b("e0", s, 10.0 - (5 - s) * 0.1)) for s in range(2, 6)] == [[]] * 4
    [(_, h)] = r.on_item(_b("e0", 6, 10.1))
    assert h[wire.H_MSG_ID] == "e0:3:6"
    # another joining relay finds the engine restarted meanwhile: its seq 0 is newer
    r2 = RelaySource("e0", known)
    msgs = r2.on_item(_b("e0", 0, 11.0))
    assert [m[1].get(wire.H_KIND) for m in msgs] == ["reset", None] and msgs[1][1][wire.H_MSG_ID] == "e0:4:0"
    # and a third one finds the stream behind the engine's buffer: a stale notice first
    r3 = RelaySource("e0", known)
    msgs = r3.on_item(_b("e0", 9, 12.0))
    stale = wire.decode_control("e0", msgs[0][0])
    assert type(stale) is SourceStale and (stale.first_missing_seq, stale.resume_seq) == (6, 9)


def _consume(messages: list[tuple[bytes, dict]]) -> list:
    out: list = []
    s = StreamSource("e0", decode_batch, out)
    for i, (payload, h) in enumerate(messages, 1):
        s.on_message(i, h, payload, 0.0)
    return out


def test_the_consumer_yields_each_seq_once_and_marks_gaps_and_restarts_like_the_zmq_subscriber() -> None:
    r = RelaySource("e0")
    msgs = [m for s in (0, 1) for m in r.on_item(_b("e0", s, 1.0 + s))]
    msgs.append(msgs[-1])  # a duplicate copy (past the duplicate window)
    msgs += r.on_item(_b("e0", 4, 5.0))  # 2..3 never reached the stream
    other = RelaySource("e0", wire.StreamPosition(0, 4, 5.0))
    restarted = other.on_item(_b("e0", 0, 9.0))  # reset + batch of instance 1
    items = _consume(msgs + restarted[1:])  # the reset message itself is lost
    kinds = [(type(i).__name__, getattr(i, "seq", None)) for i in items]
    assert kinds == [("SourceBatch", 0), ("SourceBatch", 1), ("SourceStale", None), ("SourceBatch", 2 + 2),
                     ("SourceReset", 0), ("SourceBatch", 0)]
    stale = items[2]
    assert (stale.first_missing_seq, stale.resume_seq) == (2, 4)


def test_a_consumer_that_starts_after_old_batches_aged_out_marks_them_stale() -> None:
    r = RelaySource("e0", wire.StreamPosition(0, 99, 1.0))
    items = _consume(r.on_item(_b("e0", 100, 2.0)) + r.on_item(SourceLive("e0", 100)))
    assert type(items[0]) is SourceStale and (items[0].first_missing_seq, items[0].resume_seq) == (0, 100)
    assert type(items[1]) is SourceBatch and items[2] == SourceLive("e0", 100)


def test_the_one_call_batch_path_yields_what_the_general_path_yields() -> None:
    from kvstream.wire.events import BlockStored

    r = RelaySource("e0")
    stored = KVEventBatch(1.0, [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None)])
    msgs = r.on_item(SourceBatch("e0", 0, b"kv@e0", encode_batch(stored), stored, False))
    msgs += r.on_item(SourceBatch("e0", 1, b"kv@e0", encode_batch(stored, "array"), stored, False))  # vLLM 0.11
    msgs += r.on_item(_b("e0", 2, 3.0))
    msgs.append(msgs[-1])  # a duplicate
    msgs += [(b"\xc1damaged", h) for _, h in r.on_item(_b("e0", 3, 4.0))]
    msgs += [(b"\x93" + b"\x00" * 300, h) for _, h in r.on_item(_b("e0", 4, 5.0))]  # over the size limit
    msgs += r.on_item(_b("e0", 7, 6.0))  # a gap
    msgs += RelaySource("e0", wire.StreamPosition(0, 7, 6.0)).on_item(_b("e0", 0, 9.0))[1:]  # a restart

    def run(fast: bool, runs: bool = False) -> tuple[list, dict]:
        out: list = []
        s = StreamSource("e0", lambda p: decode_batch(p) if len(p) <= 200 else decode_batch(b""), out,
                         max_payload_bytes=200)
        plain = []  # the run of plain batch messages not handed over yet (runs=True)

        def hand_over() -> None:
            if plain:
                h = plain[0][2]
                s.on_batch_run([q for q, _, _ in plain], int(h[wire.H_INSTANCE]),
                               [int(h[wire.H_SEQ]) for _, _, h in plain], h[wire.H_TOPIC].encode(),
                               [p for _, p, _ in plain], 0.0)
                plain.clear()

        for sseq, (payload, h) in enumerate(msgs, 1):
            if fast and wire.H_KIND not in h and wire.H_REPLAYED not in h:
                if runs:
                    if plain and plain[0][2][wire.H_INSTANCE] != h[wire.H_INSTANCE]:
                        hand_over()
                    plain.append((sseq, payload, h))
                    continue
                s.on_batch(sseq, int(h[wire.H_INSTANCE]), int(h[wire.H_SEQ]), h[wire.H_TOPIC].encode(), payload, 0.0)
            else:
                hand_over()
                s.on_message(sseq, h, payload, 0.0)
        hand_over()
        return out, s.counters.as_dict()

    general, fast = run(False), run(True)
    assert fast == general
    # In runs (what the consumer hands over per read), with a gap, a duplicate, damaged
    # and oversized payloads and a restart inside them: the same items and counters.
    assert run(True, runs=True) == general
    clean = run(True, runs=True)
    msgs[:] = [m for m in msgs if m[0][:1] != b"\xc1" and len(m[0]) < 200]
    assert run(True, runs=True) == run(False) != clean
    items, counters = fast
    assert [(type(i).__name__, getattr(i, "seq", None)) for i in items] == [
        ("SourceBatch", 0), ("SourceBatch", 1), ("SourceBatch", 2), ("SourceStale", None), ("SourceBatch", 7),
        ("SourceReset", 0), ("SourceBatch", 0)]
    assert items[1].batch == stored and counters["decode_errors"] == 2 and counters["duplicates"] == 1


def test_the_relays_envelope_check_reads_ts_and_counts_events_of_either_shape_and_refuses_the_rest() -> None:
    from kvstream.jetstream.relay import EnvelopeDecoder
    from kvstream.wire.events import BlockRemoved, BlockStored, EventDecodeError

    batch = KVEventBatch(12.5, [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None),
                                BlockRemoved([1], "GPU")], 3)
    dec = EnvelopeDecoder(max_payload_bytes=400)
    for shape in ("map", "array"):
        env = dec.decode(encode_batch(batch, shape))  # type: ignore[arg-type]
        assert (env.ts, len(env.events), env.data_parallel_rank) == (12.5, 2, 3)
    for bad in (b"", b"\xc1", b"\x92\xa1x\x90", encode_batch(KVEventBatch(1.0, [batch.events[0]] * 20))):
        with pytest.raises(EventDecodeError):
            dec.decode(bad)


def test_late_copies_of_reset_and_snapshot_messages_are_duplicates_not_a_second_reset() -> None:
    # A relay cut off from NATS for longer than the stream's duplicate window sends what
    # it still holds unacked when it is back: JetStream stores those copies again. The
    # consumer must take them for what they are (its engine seqs and instances say so).
    out: list = []
    s = StreamSource("e0", decode_batch, out)
    sseq = iter(range(1, 1000))

    def msg(headers: dict, payload: bytes) -> None:
        s.on_message(next(sseq), headers, payload, 0.0)

    def batch(inst: int, seq: int, snapshot: tuple[int, int] | None = None) -> None:
        payload = _b("e0", seq, float(seq)).payload
        if snapshot is None:  # a plain batch takes the consumer's fast path
            s.on_batch(next(sseq), inst, seq, b"kv@e0", payload, 0.0)
            return
        msg(wire.batch_headers("e0", inst, seq, "kv@e0", replayed=True, snapshot=snapshot), payload)

    restart = wire.control_message("e0", 1, SourceReset("e0", "restart", 0), -1)
    snap = wire.control_message("e0", 1, SourceReset("e0", "snapshot", 7), 6)
    for i in range(3):
        batch(0, i)
    msg(restart[1], restart[0])
    for i in range(5):
        batch(1, i)
    msg(restart[1], restart[0])  # the late copy
    batch(1, 5)
    msg(snap[1], snap[0])
    batch(1, 6, snapshot=(7, 0))
    batch(1, 7)
    batch(1, 8)
    msg(snap[1], snap[0])  # late copies of the snapshot reset and its batches
    batch(1, 6, snapshot=(7, 0))
    batch(1, 9)
    kinds = [(type(i).__name__, getattr(i, "seq", None)) for i in out]
    assert kinds == [("SourceBatch", 0), ("SourceBatch", 1), ("SourceBatch", 2), ("SourceReset", 0),
                     ("SourceBatch", 0), ("SourceBatch", 1), ("SourceBatch", 2), ("SourceBatch", 3),
                     ("SourceBatch", 4), ("SourceBatch", 5), ("SourceReset", 7), ("SourceBatch", 6),
                     ("SourceBatch", 7), ("SourceBatch", 8), ("SourceBatch", 9)]
    assert s.counters.duplicates == 3 and not s.state.stale and s.state.expected == 10


def test_a_snapshot_at_the_position_after_a_doubted_restart_is_a_new_instance() -> None:
    """Stream campaign seed 8: a snapshot tagged R, then a restart the subscriber reported
    (the relay doubts it), then the restarted engine's snapshot with the same tag R. Its
    reset had the id of the first one, so the stream dropped it as a copy and consumers kept
    the old engine's blocks, live."""
    r = RelaySource("e0")
    for s in range(10):
        r.on_item(_b("e0", s, 1.0 + s / 100))
    [(_, first)] = r.on_item(SourceReset("e0", "snapshot", 10))
    assert first[wire.H_INSTANCE] == "0"  # the same engine: its snapshot at its next seq
    r.on_item(_b("e0", 9, 1.2, replayed=True))
    r.on_item(SourceLive("e0", 9))
    assert r.on_item(SourceReset("e0", "restart", 9)) == []  # doubted: nothing published
    [(p, again)] = r.on_item(SourceReset("e0", "snapshot", 10))
    assert wire.decode_control("e0", p) == SourceReset("e0", "snapshot", 10)
    assert again[wire.H_INSTANCE] == "1" and again[wire.H_MSG_ID] != first[wire.H_MSG_ID]
    # Without the doubted restart, the same snapshot again is the same engine's (a copy).
    r = RelaySource("e0")
    for s in range(10):
        r.on_item(_b("e0", s, 1.0 + s / 100))
    [(_, one)] = r.on_item(SourceReset("e0", "snapshot", 10))
    r.on_item(SourceLive("e0", 9))
    [(_, two)] = r.on_item(SourceReset("e0", "snapshot", 10))
    assert two[wire.H_MSG_ID] == one[wire.H_MSG_ID] and two[wire.H_INSTANCE] == "0"

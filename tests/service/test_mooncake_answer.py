"""``/query``'s answer of one index written natively from its walk
(``MooncakeAPI._native_answer``: ``KVIndex.match_answer``, ``rust/src/answer.rs``) is byte
for byte the merged answer encoded (``KVIndex.match_rows``, ``_merge_rows``, then the
service's encoder), for every medium, DP rank, engine block size and instance name, and
its labels follow engines and source slots as they come and go."""

from __future__ import annotations

import json
from array import array

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.routing.keys import namespace
from kvstream.service.config import ServeConfig
from kvstream.service.core import ServiceCore
from kvstream.service.mooncake import MooncakeAPI, engine_name, group_name
from kvstream.service.schema import ENCODER
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.service.conftest import dead_port

BS = 16
# Instance ids the JSON text must escape, or carry as UTF-8, or that hold the name separator.
INSTANCES = ["i0", 'q"uote', "back\\slash", "ünï €", "a|b", "x" * 256, "ctl\x01\n"]
STANDARD = {"GPU", "CPU", "DISK"}
IX = group_name("m", "t", BS, "", "", "vLLM")


def _register(mc: MooncakeAPI, instance: str, rank: int, tenant: str = "t") -> str:
    mc.register(json.dumps({"endpoint": f"tcp://127.0.0.1:{dead_port()}", "type": "vLLM", "modelname": "m",
                            "instance_id": instance, "block_size": BS, "dp_rank": rank,
                            "tenant_id": tenant}).encode())
    return engine_name(instance, tenant, rank)


def _unregister(mc: MooncakeAPI, instance: str, tenant: str = "t") -> None:
    mc.unregister(json.dumps({"instance_id": instance, "tenant_id": tenant}).encode())


def _toks(doc: int, n: int) -> list[int]:
    return [(7919 * doc + 31 * j) % 50_000 for j in range(n * BS)]


def _merged(mc: MooncakeAPI, tenant: str, prompt: list[int], B: int, lora: str | None = None,
            salt: str | None = None) -> tuple[bytes, int]:
    """The oracle: the rows of the walk merged into dicts, then encoded."""
    result: dict = {}
    mc._merge_rows(result, mc.core.indexes[IX].match_rows(prompt, lora, salt)[1], B, None)
    return ENCODER.encode({tenant: result}), max((r["longest_matched"] for r in result.values()), default=0)


def _native(mc: MooncakeAPI, tenant: str, prompt: list[int], B: int, lora: str | None = None,
            salt: str | None = None, *, packed: bool = False) -> tuple[bytes, int] | None:
    ids = array("I", prompt).tobytes() if packed else prompt
    got = mc._native_answer(IX, mc.core.indexes[IX], tenant, B, ids, lora, salt)
    return None if got is None else (got[1], got[2])


_event = st.tuples(
    st.sampled_from(["store", "store", "store", "store", "remove", "clear"]),
    st.integers(0, 3),  # document
    st.integers(1, 6),  # blocks
    st.sampled_from(["GPU", "GPU", "CPU", "DISK", "NVME"]),
    st.sampled_from([BS, BS, BS, 2 * BS]),  # an engine block of two router blocks
    st.sampled_from([None, None, "adapter"]),
)
_steps = st.lists(st.tuples(st.integers(0, 11), st.lists(_event, min_size=1, max_size=4)), min_size=1, max_size=30)


def _apply(mc: MooncakeAPI, source: str, events: list, t: float) -> None:
    out = []
    for kind, doc, n, medium, bsz, lora in events:
        if kind == "clear":
            out.append(AllBlocksCleared())
            continue
        per = bsz // BS
        hashes = [(doc << 20) + (per << 16) + i for i in range(n)]
        if kind == "remove":
            out.append(BlockRemoved(hashes[-1:], medium, 0))
        else:
            out.append(BlockStored(hashes, None, _toks(doc, n * per), bsz, None, medium, lora, None, 0))
    mc.core.indexes[IX].apply_batch(source, KVEventBatch(t, out))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.sampled_from([1, 16, 64]), st.sampled_from(["t", 'te"n', "ténant"]))
def test_the_native_answer_is_the_merged_answer_byte_for_byte(steps, B, tenant) -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    # 12 sources: four instances with three DP ranks each (their rows merge into one)
    names = [_register(mc, inst, rank) for inst in INSTANCES[:4] for rank in (0, 1, 3)]
    for t, (k, events) in enumerate(steps):
        _apply(mc, names[k], events, float(t))
    ix = mc.core.indexes[IX]
    held = {ix._media[t] for t, h in enumerate(ix._held) if h}
    taken = 0
    for doc in range(4):
        for lora in (None, "adapter"):
            prompt = _toks(doc, 6) + [1, 2, 3]  # a partial tail block is ignored
            want = _merged(mc, tenant, prompt, B, lora)
            for packed in (False, True):
                got = _native(mc, tenant, prompt, B, lora, packed=packed)
                if got is None:
                    assert held - STANDARD, held  # only a medium the answer has no column for
                    continue
                assert got == want, (prompt, lora)
                json.loads(got[0])
                taken += 1
    assert taken or held - STANDARD


def test_answers_through_query_and_query_by_hash_equal_the_merge() -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    a0, a1, b0 = _register(mc, "a", 0), _register(mc, "a", 2), _register(mc, "b", 0)
    _apply(mc, a0, [("store", 0, 4, "GPU", BS, None)], 0.0)
    _apply(mc, a1, [("store", 0, 6, "CPU", BS, None), ("store", 1, 2, "DISK", BS, None)], 1.0)
    _apply(mc, b0, [("store", 0, 1, "GPU", 2 * BS, None), ("store", 0, 3, "DISK", BS, None)], 2.0)
    prompt = _toks(0, 6)
    body = json.dumps({"model": "m", "tenant_id": "t", "token_ids": prompt, "block_size": BS}).encode()
    want = _merged(mc, "t", prompt, BS)[0]
    assert mc.query(body) == want
    assert json.loads(want) == {"t": {
        "a": {"longest_matched": 96, "GPU": 64, "CPU": 96, "DISK": 0, "DP": {"0": 64, "2": 96}},
        "b": {"longest_matched": 48, "GPU": 32, "CPU": 0, "DISK": 48, "DP": {"0": 48}}}}
    # an instance filter takes the merge: the same rows, one instance
    only = json.loads(mc.query(json.dumps({"model": "m", "tenant_id": "t", "token_ids": prompt, "block_size": BS,
                                           "instance_id": "b"}).encode()))
    assert only == {"t": {"b": json.loads(want)["t"]["b"]}}
    # a salted prompt chains from another root: nothing matches
    assert mc.query(json.dumps({"model": "m", "tenant_id": "t", "token_ids": prompt, "block_size": BS,
                                "cache_salt": "s"}).encode()) == b'{"t":{}}'
    assert namespace(None, "s") != namespace()


def test_query_by_hash_over_an_engine_keyed_group_equals_the_merge() -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    names = []
    for inst, rank in (("a", 0), ("a", 1), ('q"b', 0)):
        mc.register(json.dumps({"endpoint": f"tcp://127.0.0.1:{dead_port()}", "type": "Mooncake",
                                "modelname": "m", "instance_id": inst, "block_size": BS, "dp_rank": rank,
                                "tenant_id": "t"}).encode())
        names.append(engine_name(inst, "t", rank))
    ixname = group_name("m", "t", BS, "", "", "Mooncake")
    ix = mc.core.indexes[ixname]
    seq = [101, 102, 103, 104]
    for name, n, medium in zip(names, (2, 4, 3), ("GPU", "CPU", "DISK")):
        ix.apply_batch(name, KVEventBatch(0.0, [BlockStored(seq[:n], None, [], BS, None, medium, None)]))
    result: dict = {}
    mc._merge_rows(result, ix.match_rows((), keys=seq)[1], BS, None)
    want = ENCODER.encode({"t": result})
    assert json.loads(want) == {"t": {
        "a": {"longest_matched": 64, "GPU": 32, "CPU": 64, "DISK": 0, "DP": {"0": 32, "1": 64}},
        'q"b': {"longest_matched": 48, "GPU": 0, "CPU": 0, "DISK": 48, "DP": {"0": 48}}}}
    for body in ({"model": "m", "tenant_id": "t", "block_size": BS, "seq_hashes": seq},
                 {"model": "m", "tenant_id": "t", "block_size": BS, "block_hash": seq},
                 {"model": "m", "tenant_id": "t", "block_size": BS, "seq_hashes": seq, "x": [[1]]}):
        assert mc.query_by_hash(json.dumps(body).encode()) == want, body
    got = mc._native_answer(ixname, ix, "t", BS, (), keys=array("Q", seq).tobytes())
    assert got is not None and got[1:] == (want, 64)


def test_labels_follow_engines_and_slots_as_they_come_and_go() -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    _register(mc, "keeper", 0)  # holds nothing; keeps the group (and its index) while i0 is gone
    first = _register(mc, "i0", 0)
    _apply(mc, first, [("store", 0, 2, "GPU", BS, None)], 0.0)
    prompt = _toks(0, 2)
    assert _native(mc, "t", prompt, BS) == _merged(mc, "t", prompt, BS)
    for k in range(200):  # engines that come and go, each answered while it holds a prefix
        name = _register(mc, f"churn{k}", k % 3)
        _apply(mc, name, [("store", 0, 1, "GPU", BS, None)], float(k))
        got = _native(mc, "t", prompt, BS)
        assert got == _merged(mc, "t", prompt, BS)
        assert f'"churn{k}"'.encode() in got[0]
        _unregister(mc, f"churn{k}")  # its blocks leave (no subscriber to drain here): the slot is free
        assert f'"churn{k}"'.encode() not in _native(mc, "t", prompt, BS)[0]
    assert len(mc.core.indexes[IX].slot_sources()) <= 3
    # i0 gone and i1 in its slot (and i0 back in another): each row under its own labels
    _unregister(mc, "i0")
    _apply(mc, _register(mc, "i1", 5), [("store", 0, 1, "GPU", BS, None)], 300.0)
    assert _register(mc, "i0", 0) == first
    _apply(mc, first, [("store", 0, 2, "CPU", BS, None)], 301.0)
    got = _native(mc, "t", prompt, BS)
    assert got == _merged(mc, "t", prompt, BS)
    assert json.loads(got[0]) == {"t": {
        "i1": {"longest_matched": 16, "GPU": 16, "CPU": 0, "DISK": 0, "DP": {"5": 16}},
        "i0": {"longest_matched": 32, "GPU": 0, "CPU": 32, "DISK": 0, "DP": {"0": 32}}}}


def test_a_source_in_another_slot_under_the_same_engines_is_labelled_by_its_slot() -> None:
    """A source can leave an index and come back in another slot while the engines stay
    (an engine re-registered while its old incarnation drains joins its index later):
    the labels follow the slots, not only the engines."""
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    a, b = _register(mc, "a", 0), _register(mc, "b", 0)
    prompt = _toks(0, 2)
    _apply(mc, a, [("store", 0, 2, "GPU", BS, None)], 0.0)
    assert json.loads(_native(mc, "t", prompt, BS)[0])["t"].keys() == {"a"}
    ix = mc.core.indexes[IX]
    ix.remove_source(b)
    ix.remove_source(a)
    assert _native(mc, "t", prompt, BS) == (b'{"t":{}}', 0)
    ix.add_source(b)  # b now in a's old slot
    _apply(mc, b, [("store", 0, 1, "GPU", BS, None)], 1.0)
    got = _native(mc, "t", prompt, BS)
    assert got == _merged(mc, "t", prompt, BS)
    assert json.loads(got[0]) == {"t": {"b": {"longest_matched": 16, "GPU": 16, "CPU": 0, "DISK": 0,
                                              "DP": {"0": 16}}}}


def test_a_source_with_a_larger_engine_block_counts_whole_engine_blocks() -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    a = _register(mc, "a", 0)
    b = _register(mc, "b", 0)
    # "a": two engine blocks of two router blocks each; a prompt of three router blocks
    # reuses one whole engine block. "b": three router blocks of document 0, then an
    # engine block of two router blocks (another document): a source of two block sizes
    # (a hybrid model's groups), whose prefix is the union of its blocks, not rounded.
    _apply(mc, a, [("store", 0, 2, "GPU", 2 * BS, None)], 0.0)
    _apply(mc, b, [("store", 0, 3, "GPU", BS, None), ("store", 1, 1, "CPU", 2 * BS, None)], 0.0)
    prompt = _toks(0, 3)
    got = _native(mc, "t", prompt, BS)
    assert got == _merged(mc, "t", prompt, BS)
    assert json.loads(got[0]) == {"t": {
        "a": {"longest_matched": 32, "GPU": 32, "CPU": 0, "DISK": 0, "DP": {"0": 32}},
        "b": {"longest_matched": 48, "GPU": 48, "CPU": 0, "DISK": 0, "DP": {"0": 48}}}}


def test_the_labels_of_indexes_gone_are_dropped() -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    for k in range(100):  # a group per model, each answered once and then emptied
        mc.register(json.dumps({"endpoint": f"tcp://127.0.0.1:{dead_port()}", "type": "vLLM",
                                "modelname": f"m{k}", "instance_id": "i", "block_size": BS,
                                "dp_rank": 0}).encode())
        assert mc.query(json.dumps({"model": f"m{k}", "token_ids": _toks(0, 1),
                                    "block_size": BS}).encode()) == b'{"default":{}}'
        _unregister(mc, "i", "default")
    assert len(mc._slot_labels) <= len(mc.core.indexes) + 17

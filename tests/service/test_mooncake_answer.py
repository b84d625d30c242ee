"""``/query``'s answer written as text from one index's rows (``MooncakeAPI._text_answer``)
is byte for byte the merged answer encoded (``_merge_rows`` then the service's encoder),
and it gives way to the merge exactly when a row needs it."""

from __future__ import annotations

import json
import random

from kvstream.service.config import ServeConfig
from kvstream.service.core import ServiceCore
from kvstream.service.mooncake import MooncakeAPI, engine_name
from kvstream.service.schema import ENCODER
from tests.service.conftest import dead_port

# Instance ids the JSON text must escape, or carry as UTF-8, or that hold the name separator.
INSTANCES = ["i0", 'q"uote', "back\\slash", "ünï €", "a|b", "x" * 256, "ctl\x01\n"]
STANDARD = {"GPU", "CPU", "DISK"}


def _register(mc: MooncakeAPI, instance: str, rank: int, tenant: str = "t") -> str:
    mc.register(json.dumps({"endpoint": f"tcp://127.0.0.1:{dead_port()}", "type": "vLLM", "modelname": "m",
                            "instance_id": instance, "block_size": 16, "dp_rank": rank,
                            "tenant_id": tenant}).encode())
    return engine_name(instance, tenant, rank)


def _merged(mc: MooncakeAPI, tenant: str, rows: list, B: int, only: str | None) -> tuple[bytes, int]:
    result: dict = {}
    mc._merge_rows(result, rows, B, only)
    return ENCODER.encode({tenant: result}), max((r["longest_matched"] for r in result.values()), default=0)


def test_the_text_answer_is_the_merged_answer_byte_for_byte_or_gives_way_to_it() -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    names = [_register(mc, inst, rank) for inst in INSTANCES for rank in (0, 1, 3)]
    inst_of = {engine_name(i, "t", r): i for i in INSTANCES for r in (0, 1, 3)}
    pool = names + ["unknown|t|0"]
    media = [("GPU",), ("GPU",), ("GPU", "CPU"), ("CPU",), ("GPU", "CPU", "DISK"), ("DISK",), ("GPU", "NVME"), ()]
    rng = random.Random(7)
    taken = merged = 0
    for round in range(4000):
        if round % 3 == 0:  # one source per instance: the usual answer, rank 0 or not
            sources = [engine_name(i, "t", rng.choice((0, 1, 3))) for i in rng.sample(INSTANCES, rng.randrange(8))]
        else:
            sources = rng.sample(pool, rng.randrange(len(pool) + 1))
        rows = []
        for s in sources:
            nb = rng.randrange(1, 300)
            if rng.random() < 0.4:  # the usual row: the whole prefix in GPU
                rows.append((s, nb, {"GPU": nb}))
            else:
                rows.append((s, nb, {m: rng.randrange(0, nb + 1) for m in rng.choice(media)}))
        only = rng.choice([None, None, None, rng.choice(INSTANCES), "nobody"])
        B = rng.choice([1, 16, 64])
        want = _merged(mc, "t", rows, B, only)
        got = mc._text_answer("t", rows, B, only)
        kept = [(inst_of[s], tiers) for s, _, tiers in rows
                if s in inst_of and (only is None or inst_of[s] == only)]
        needs_merge = (len({i for i, _ in kept}) < len(kept)
                       or any(set(tiers) - STANDARD for _, tiers in kept))
        assert (got is None) == needs_merge, (rows, only)
        if got is None:
            merged += 1
        else:
            assert got == want, (rows, only)
            json.loads(got[0])  # and it is JSON
            taken += 1
    assert taken > 1500 and merged > 500, (taken, merged)


def test_an_instance_registered_again_is_labelled_anew_and_old_labels_do_not_pile_up() -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[])))
    first = _register(mc, "i0", 0)
    rows = [(first, 4, {"GPU": 4})]
    assert mc._text_answer("t", rows, 16, None) == _merged(mc, "t", rows, 16, None)
    for k in range(400):  # engines that come and go, each answered once
        name = _register(mc, f"churn{k}", 2)
        churn = [(name, 1, {"GPU": 1}), (first, 2, {"GPU": 2})]
        assert mc._text_answer("t", churn, 16, None) == _merged(mc, "t", churn, 16, None)
        mc.unregister(json.dumps({"instance_id": f"churn{k}", "tenant_id": "t"}).encode())
    assert len(mc._labels) <= 2 * len(mc.core.engines) + 65
    # the same name registered again (a new engine, another rank's key in its row)
    mc.unregister(json.dumps({"instance_id": "i0", "tenant_id": "t"}).encode())
    again = _register(mc, "i0", 0)
    assert again == first
    assert mc._text_answer("t", rows, 16, None) == _merged(mc, "t", rows, 16, None)
    assert mc._text_answer("t", rows, 16, None)[0] == b'{"t":{"i0":{"longest_matched":64,"GPU":64,"CPU":0,' \
                                                     b'"DISK":0,"DP":{"0":64}}}}'

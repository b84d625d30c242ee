"""The Mooncake KV indexer API (RFC kvcache-ai/Mooncake#1403), checked with a client written
from the RFC's text, against real publishers and ``kvstream serve`` as a process."""

from __future__ import annotations

import struct
from typing import Any

import httpx
import xxhash

from kvstream.hashing import BlockHasher, to_external_list
from tests.service.conftest import wait_for


class IndexerClient:
    """A client of the RFC #1403 indexer API, from the RFC's field tables."""

    def __init__(self, http: httpx.Client, token: str | None = None) -> None:
        self.http = http
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def register(self, *, endpoint: str, type: str, modelname: str, instance_id: str, block_size: int,
                 dp_rank: int, replay_endpoint: str | None = None, lora_name: str | None = None,
                 tenant_id: str | None = None, additionalsalt: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"endpoint": endpoint, "type": type, "modelname": modelname,
                                "instance_id": instance_id, "block_size": block_size, "dp_rank": dp_rank}
        for k, v in (("replay_endpoint", replay_endpoint), ("lora_name", lora_name), ("tenant_id", tenant_id),
                     ("additionalsalt", additionalsalt)):
            if v is not None:
                body[k] = v
        return self.http.post("/register", json=body, headers=self.headers)

    def unregister(self, **body: Any) -> httpx.Response:
        return self.http.post("/unregister", json=body, headers=self.headers)

    def query(self, **body: Any) -> httpx.Response:
        return self.http.post("/query", json=body)

    def query_by_hash(self, **body: Any) -> httpx.Response:
        return self.http.post("/query_by_hash", json=body)


def _ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def _spec_seq_hashes(tokens: list[int], bs: int, seed: int = 0) -> list[int]:
    out: list[int] = []
    for i in range(len(tokens) // bs):
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs]), seed)
        out.append(local if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed))
    return out


PROMPT = [3000 + i for i in range(64)]  # 4 engine blocks of 16


def test_vllm_publishers_are_isolated_per_model_and_tenant(engines, serve) -> None:
    a, b, c = engines("a"), engines("b"), engines("c")
    srv = serve("--load-interval", "0")
    cl = IndexerClient(srv.client)
    for eng, model, tenant in ((a, "m", "t1"), (b, "m", "t2"), (c, "other", "t1")):
        reg = _ok(cl.register(endpoint=eng.pub, replay_endpoint=eng.replay, type="vLLM", modelname=model,
                              instance_id=eng.name, block_size=16, dp_rank=0, tenant_id=tenant))
        assert reg == {"status": "registered successfully", "instance_id": eng.name}
    for eng, tenant in ((a, "t1"), (b, "t2"), (c, "t1")):
        srv.wait_applied(f"{eng.name}|{tenant}|0", eng.admit(PROMPT, "r"))

    got = _ok(cl.query(model="m", token_ids=PROMPT + [1, 2], block_size=16, tenant_id="t1"))
    assert got == {"t1": {"a": {"longest_matched": 64, "GPU": 64, "CPU": 0, "DISK": 0, "DP": {"0": 64}}}}
    assert _ok(cl.query(model="m", token_ids=PROMPT, block_size=16, tenant_id="t2"))["t2"]["b"]["longest_matched"] == 64
    # the default tenant is "default"; nothing of it is registered
    assert _ok(cl.query(model="m", token_ids=PROMPT, block_size=16)) == {"default": {}}
    # another block size is another index
    assert _ok(cl.query(model="m", token_ids=PROMPT, block_size=32, tenant_id="t1")) == {"t1": {}}
    # a LoRA or salt the engine's blocks were not stored under does not match them
    lora = _ok(cl.query(model="m", token_ids=PROMPT, block_size=16, tenant_id="t1", lora_name="sql"))
    assert lora == {"t1": {}}  # instances with no cached prefix are left out

    # by hash: the engine's own block hashes (sha256_cbor, seed "0": how engine_proc hashes)
    hashes = to_external_list(BlockHasher("sha256_cbor", 16, seed="0").hash_blocks(PROMPT))
    got = _ok(cl.query_by_hash(model="m", seq_hashes=hashes[:3] + [12345], block_size=16, tenant_id="t1"))
    assert got == {"t1": {"a": {"longest_matched": 48, "GPU": 48, "CPU": 0, "DISK": 0, "DP": {"0": 48}}}}
    assert _ok(cl.query_by_hash(model="m", block_hash=hashes, block_size=16, tenant_id="t1",
                                instance_id="a"))["t1"]["a"]["longest_matched"] == 64

    out = _ok(cl.unregister(type="vLLM", modelname="m", tenant_id="t1", instance_id="a", block_size=16, dp_rank=0))
    assert out == {"status": "unregistered successfully", "removed_instances": ["a|t1|0"]}
    assert _ok(cl.query(model="m", token_ids=PROMPT, block_size=16, tenant_id="t1")) == {"t1": {}}
    r = cl.unregister(instance_id="a", tenant_id="t1", dp_rank=0)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_instance"


def test_mooncake_publishers_speak_rfc_1527_events_and_the_standard_hash(engines, serve) -> None:
    m = engines("m0")
    srv = serve("--load-interval", "0")
    cl = IndexerClient(srv.client)
    _ok(cl.register(endpoint=m.pub, replay_endpoint=m.replay, type="Mooncake", modelname="ds", instance_id="m0",
                    block_size=4, dp_rank=1, tenant_id="default"))
    tokens = list(range(100, 116))
    seq = _spec_seq_hashes(tokens, 4)
    env = {"model_name": "ds", "block_size": 4, "tenant_id": "default", "backend_id": "daemon-0", "dp_rank": 1}
    m.cmd(rfc=[{**env, "event_id": 1, "event_type": "stored", "medium": "gpu", "seq_hashes": seq,
                "base_block_idx": 0, "parent_hash": None}], dp_rank=1)
    last = m.cmd(rfc=[{**env, "event_id": 2, "event_type": "stored", "medium": "cpu", "seq_hashes": seq[:2],
                       "base_block_idx": 0, "parent_hash": None}], dp_rank=1)["seq"]
    srv.wait_applied("m0|default|1", last)

    want = {"default": {"m0": {"longest_matched": 16, "GPU": 16, "CPU": 8, "DISK": 0, "DP": {"1": 16}}}}
    assert _ok(cl.query(model="ds", token_ids=tokens, block_size=4)) == want
    assert _ok(cl.query_by_hash(model="ds", seq_hashes=seq, block_size=4)) == want

    last = m.cmd(rfc=[{**env, "event_id": 3, "event_type": "removed", "medium": "gpu", "seq_hashes": seq[3:],
                       "base_block_idx": 3}], dp_rank=1)["seq"]
    srv.wait_applied("m0|default|1", last)
    got = _ok(cl.query_by_hash(model="ds", seq_hashes=seq, block_size=4))["default"]["m0"]
    assert got["longest_matched"] == 12 and got["GPU"] == 12 and got["CPU"] == 8
    # blocks of another block size in the envelope are not mixed in
    last = m.cmd(rfc=[{**env, "block_size": 8, "event_id": 4, "event_type": "stored", "medium": "gpu",
                       "seq_hashes": seq[3:], "parent_hash": seq[2]}], dp_rank=1)["seq"]
    srv.wait_applied("m0|default|1", last)
    assert _ok(cl.query_by_hash(model="ds", seq_hashes=seq, block_size=4))["default"]["m0"]["GPU"] == 12


def test_register_and_unregister_need_the_bearer_token(engines, serve, tmp_path) -> None:
    a = engines("a")
    (tmp_path / "token").write_text("s3cret\n")
    srv = serve("--load-interval", "0", "--register-token-file", str(tmp_path / "token"))
    reg = dict(endpoint=a.pub, type="vLLM", modelname="m", instance_id="a", block_size=16, dp_rank=0)
    for token in (None, "wrong"):
        r = IndexerClient(srv.client, token).register(**reg)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert srv.engines() == {}
    ok = IndexerClient(srv.client, "s3cret")
    _ok(ok.register(**reg))
    assert _ok(ok.register(**reg))["status"] == "registered successfully"  # idempotent
    r = ok.register(**{**reg, "endpoint": "tcp://127.0.0.1:1"})
    assert r.status_code == 409
    assert IndexerClient(srv.client).unregister(instance_id="a").status_code == 401
    assert _ok(ok.unregister(instance_id="a"))["removed_instances"] == ["a|default|0"]
    # queries need no token
    assert _ok(IndexerClient(srv.client).query(model="m", token_ids=[1], block_size=16)) == {"default": {}}
    wait_for(lambda: srv.engines() == {}, "a to be gone")


def test_a_registration_reaches_every_worker(engines, serve) -> None:
    a = engines("a")
    srv = serve("--load-interval", "0", "--workers", "2")
    # one connection, so one worker takes the registration
    _ok(IndexerClient(srv.client).register(endpoint=a.pub, replay_endpoint=a.replay, type="vLLM", modelname="m",
                                           instance_id="a", block_size=16, dp_rank=0))
    a.admit(PROMPT, "r")

    def every_worker(want: dict) -> bool:
        # fresh connections land on either worker (SO_REUSEPORT): several in a row must agree
        for _ in range(12):
            with httpx.Client(base_url=srv.url) as c:
                if _ok(IndexerClient(c).query(model="m", token_ids=PROMPT, block_size=16)) != want:
                    return False
        return True

    row = {"longest_matched": 64, "GPU": 64, "CPU": 0, "DISK": 0, "DP": {"0": 64}}
    wait_for(lambda: every_worker({"default": {"a": row}}), "both workers to follow the registered engine")
    _ok(IndexerClient(srv.client).unregister(instance_id="a"))
    wait_for(lambda: every_worker({"default": {}}), "both workers to drop the unregistered engine")
    assert srv.close() == 0


def _by_endpoint(srv: Any, endpoint: str) -> dict | None:
    return next((e for e in srv.engines().values() if e["endpoint"] == endpoint), None)


def test_names_with_the_separator_never_collide_or_share_an_index(engines, serve) -> None:
    # Before: registrations were keyed "instance|tenant|rank" and indexes
    # "mooncake:model|tenant|...", joined without escaping, so ("a|b", "c") and ("a", "b|c")
    # were the same engine (a spurious 409), and models "m|t" / "m" of tenants "x" / "t|x"
    # were one index (each saw the other's blocks).
    a, b, c, d = engines("a"), engines("b"), engines("c"), engines("d")
    srv = serve("--load-interval", "0")
    cl = IndexerClient(srv.client)
    regs = [(a, "m", "a|b", "c"), (b, "m", "a", "b|c"),  # same "a|b|c|0" under the old joining
            (c, "m|t", "i", "x"), (d, "m", "i", "t|x")]  # same "mooncake:m|t|x|16|||vLLM"
    for eng, model, inst, tenant in regs:
        _ok(cl.register(endpoint=eng.pub, replay_endpoint=eng.replay, type="vLLM", modelname=model,
                        instance_id=inst, block_size=16, dp_rank=0, tenant_id=tenant))
    seqs = {eng.pub: eng.admit([k * 1000 + t for t in PROMPT], "r") for k, (eng, *_) in enumerate(regs, 1)}

    def applied() -> bool:
        return all((e := _by_endpoint(srv, p)) is not None and e["state"] == "live"
                   and (e["applied_seq"] if e["applied_seq"] is not None else -1) >= s for p, s in seqs.items())

    wait_for(applied, "all four registrations live with their prompt applied")
    views = [_by_endpoint(srv, eng.pub) for eng, *_ in regs]
    assert len({v["name"] for v in views}) == 4 and len({v["index"] for v in views}) == 4
    for k, (eng, model, inst, tenant) in enumerate(regs, 1):
        row = {"longest_matched": 64, "GPU": 64, "CPU": 0, "DISK": 0, "DP": {"0": 64}}
        for j in range(1, 5):  # only its own prompt matches, in its own (model, tenant)
            got = _ok(cl.query(model=model, token_ids=[j * 1000 + t for t in PROMPT], block_size=16, tenant_id=tenant))
            assert got == {tenant: {inst: row} if j == k else {}}, (k, j, got)
        assert _ok(cl.query(model=model, token_ids=[k * 1000 + t for t in PROMPT], block_size=16, tenant_id=tenant,
                            instance_id=inst)) == {tenant: {inst: row}}
    metrics = srv.client.get("/metrics").text
    assert all(f'engine="{v["name"]}"' in metrics.replace("\\\\", "\\") for v in views)
    # unregistering one leaves the other of each colliding pair
    gone = _ok(cl.unregister(instance_id="a|b", tenant_id="c"))["removed_instances"]
    assert gone == [views[0]["name"]]
    wait_for(lambda: _by_endpoint(srv, a.pub) is None, "a to be gone")
    assert _by_endpoint(srv, b.pub) is not None
    assert _ok(cl.query(model="m", token_ids=[2000 + t for t in PROMPT], block_size=16, tenant_id="b|c"))["b|c"]["a"]
    assert _ok(cl.unregister(instance_id="a", tenant_id="b|c", dp_rank=0))["removed_instances"] == [views[1]["name"]]
    assert _ok(cl.unregister(instance_id="i", tenant_id="t|x"))["removed_instances"] == [views[3]["name"]]
    wait_for(lambda: _by_endpoint(srv, d.pub) is None, "d to be gone")
    assert _by_endpoint(srv, c.pub) is not None


def test_a_reload_keeps_instances_registered_into_the_configured_engines_group(engines, serve, tmp_path) -> None:
    # Before: a vLLM registration of --model-name, tenant default and the router block size
    # shares the configured engines' index, and SIGHUP's reload dropped it as "not in the
    # config" (while /unregister still named it).
    import signal

    e0, a = engines("e0"), engines("a")
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'engines = ["{e0.arg}"]\nload-interval = 0\n')
    srv = serve("--config", str(cfg))
    cl = IndexerClient(srv.client)
    _ok(cl.register(endpoint=a.pub, replay_endpoint=a.replay, type="vLLM", modelname="default", instance_id="a",
                    block_size=16, dp_rank=0))
    srv.wait_applied("a|default|0", a.admit(PROMPT, "r"))
    srv.signal(signal.SIGHUP)
    wait_for(lambda: "reloaded " in srv.stderr(), "the reload")
    assert set(srv.engines()) == {"e0", "a|default|0"}
    want = {"default": {"a": {"longest_matched": 64, "GPU": 64, "CPU": 0, "DISK": 0, "DP": {"0": 64}}}}
    assert _ok(cl.query(model="default", token_ids=PROMPT, block_size=16)) == want

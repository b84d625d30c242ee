"""A real engine for the service tests, run as its own process: kvstream's allocator
(``BlockPool`` + ``KVCacheManager``) publishing its real events with kvstream's
``Publisher`` (PUB + replay on loopback, ports chosen by the OS), and a vLLM-style
``/metrics`` endpoint (plain asyncio HTTP) exporting the load the test sets.

Protocol: one JSON command per stdin line, one JSON answer per stdout line.

* start: prints ``{"pub": EP, "replay": EP, "http": URL}``;
* ``{"admit": [tokens...], "id": "r1"}`` caches the prompt's blocks -> ``{"seq": N}``;
* ``{"free": "r1"}`` frees a request (its blocks stay cached until evicted) -> ``{"seq": N}``;
* ``{"load": {"running": 3, "waiting": 5, "kv": 0.5}}`` -> ``{"ok": true}``;
* ``{"raw": HEX, "seq": N}`` publishes an encoded vLLM payload as batch ``N`` (default: the
  next seq; a lower one is a new engine incarnation, as after a restart) -> ``{"seq": N}``;
* ``{"rfc": [event maps], "dp_rank": 0}`` publishes one RFC #1527 batch
  ``[timestamp ms, events, dp_rank]`` as the test wrote it -> ``{"seq": N}``;
* end of stdin: exits.

Any HTTP request other than ``GET /metrics`` gets ``{"served_by": NAME}`` (NAME: argv[1]).

``seq`` is the last published batch's seq (-1 if the step changed nothing).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import anyio
import msgspec

from kvstream.allocator.shell import AsyncKVCacheManager
from kvstream.hashing import BlockHasher
from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool
from kvstream.transport import KVEventsConfig, Publisher

BLOCK_SIZE = 16
NAME = sys.argv[1] if len(sys.argv) > 1 else "engine"
LOAD = {"running": 0, "waiting": 0, "kv": 0.0}


def _metrics_text() -> bytes:
    labels = '{engine="0",model_name="test-model"}'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{labels} {float(LOAD['running'])}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{labels} {float(LOAD['waiting'])}\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{labels} {float(LOAD['kv'])}\n"
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        f"vllm:prompt_tokens_total{labels} 1234.0\n"
    ).encode()


async def _http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        line = await reader.readline()
        length = 0
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            if h.lower().startswith(b"content-length:"):
                length = int(h.split(b":", 1)[1])
        if length:
            await reader.readexactly(length)
        if line.startswith(b"GET /metrics"):
            body, status = _metrics_text(), b"200 OK"
        else:  # anything else: say who served it (the gateway example checks the choice)
            body, status = json.dumps({"served_by": NAME}).encode(), b"200 OK"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
    finally:
        writer.close()


async def main() -> None:
    pool = BlockPool(num_gpu_blocks=4096, block_size=BLOCK_SIZE)
    manager = KVCacheManager(pool, BlockHasher("sha256_cbor", BLOCK_SIZE, seed="0"))
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv")
    server = await asyncio.start_server(_http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reqs = {}
    stdin = anyio.wrap_file(sys.stdin)
    async with server, Publisher(cfg) as pub, AsyncKVCacheManager(manager, pub.publish) as kv:
        pub.snapshot_provider = kv.snapshot_events
        print(json.dumps({"pub": pub.endpoint, "replay": pub.replay_endpoint, "http": f"http://127.0.0.1:{port}"}),
              flush=True)
        async for line in stdin:
            cmd = json.loads(line)
            if "load" in cmd:
                LOAD.update(cmd["load"])
                print(json.dumps({"ok": True}), flush=True)
                continue
            if "raw" in cmd:
                seq = cmd.get("seq", pub.next_seq)
                pub.publish_raw(bytes.fromhex(cmd["raw"]), seq)
                print(json.dumps({"seq": seq}), flush=True)
                continue
            if "rfc" in cmd:
                seq = pub.next_seq
                pub.publish_raw(msgspec.msgpack.encode([int(time.time() * 1000), cmd["rfc"], cmd.get("dp_rank", 0)]),
                                seq)
                print(json.dumps({"seq": seq}), flush=True)
                continue
            if "admit" in cmd:
                req = manager.new_request(cmd["id"], cmd["admit"])
                if not manager.admit(req):
                    print(json.dumps({"error": "no room"}), flush=True)
                    continue
                reqs[cmd["id"]] = req
            elif "free" in cmd:
                manager.free(reqs.pop(cmd["free"]))
            batch = await kv.step_done()
            print(json.dumps({"seq": pub.next_seq - 1 if batch is not None else -1}), flush=True)


if __name__ == "__main__":
    anyio.run(main)

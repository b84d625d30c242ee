"""examples/k8s/: the Kubernetes objects validate against Kubernetes' published schemas
(offline, strict: unknown fields fail), kvstream's config in the ConfigMap loads, and the
InferencePool, Service, Deployment and config agree on names and ports. The InferencePool
itself is not schema-checked (no offline validator ships its CRD): examples/k8s/README.md
says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvstream.service.config import build_config, load_file
from tests.service.conftest import REPO

K8S = REPO / "examples" / "k8s"
KUBE_VERSION = "1.33.0"


def docs() -> dict[str, dict[str, Any]]:
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            out[d["kind"]] = d
    return out


@pytest.mark.parametrize("kind", ["ConfigMap", "Deployment", "Service"])
def test_the_kubernetes_objects_match_the_published_schemas(kind: str) -> None:
    kubernetes_validate.validate(docs()[kind], KUBE_VERSION, strict=True)


def test_a_misspelt_field_is_caught_by_that_check() -> None:
    bad = docs()["Service"]
    bad["spec"]["portz"] = bad["spec"].pop("ports")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_the_config_map_holds_a_config_kvstream_serve_loads(tmp_path: Path) -> None:
    f = tmp_path / "serve.toml"
    f.write_text(docs()["ConfigMap"]["data"]["serve.toml"])
    values = load_file(str(f))
    tok = tmp_path / "tok"
    tok.mkdir()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    f.write_text(docs()["ConfigMap"]["data"]["serve.toml"].replace("/models/tokenizer", str(tok))
                 .replace("/etc/kvstream-token/token", str(token)))
    cfg = build_config({}, [], str(f))
    assert cfg.ext_proc_port == 9002 and values["host"] == "0.0.0.0"
    assert all(e.http and e.http.startswith("http://10.") for e in cfg.engines)  # pod IPs: the gateway routes to them


def test_pool_service_deployment_and_config_agree() -> None:
    d = docs()
    pool, svc, dep, cm = d["InferencePool"], d["Service"], d["Deployment"], d["ConfigMap"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == svc["metadata"]["name"] and ref["kind"] == "Service"
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    container = dep["spec"]["template"]["spec"]["containers"][0]
    cport = next(p for p in container["ports"] if p["name"] == port["targetPort"])
    assert "ext-proc-port = %d" % cport["containerPort"] in cm["data"]["serve.toml"]
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    assert ref["failureMode"] == "FailOpen"
    engine_port = pool["spec"]["targetPorts"][0]["number"]
    assert f":{engine_port}\"" in cm["data"]["serve.toml"] or f":{engine_port}," in cm["data"]["serve.toml"]

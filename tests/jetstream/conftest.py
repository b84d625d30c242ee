"""Fixtures: real nats-server processes (JetStream, file storage in the test's tmp dir) and
real engines (kvstream's allocator behind kvstream's ZMQ Publisher)."""

from __future__ import annotations

import pytest

from kvstream.jetstream.server import NatsCluster, NatsServer

pytest.importorskip("nats", reason="the JetStream tests need kvstream[nats] (nats-py)")


@pytest.fixture
def nats_server(tmp_path):
    """One JetStream-enabled nats-server on an ephemeral loopback port; stopped after."""
    srv = NatsServer(tmp_path / "nats")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def nats_cluster(tmp_path):
    """Three routed JetStream nats-servers on loopback; stopped after."""
    cl = NatsCluster(tmp_path / "cluster", size=3)
    cl.start()
    try:
        yield cl
    finally:
        cl.stop()

"""A whole gateway with graph mode forced on: the GPU's start-up path, run on this CPU.

``GATEWAY_CUDA_GRAPHS=on`` on a CPU device puts the batched engine's step through the capture
stand-in (gateway/tts/graphs.py): the app warms the engine before ``/readyz`` as it would on a
GPU, which captures every batch bucket and attended length; then a caller is greeted and
answered from replayed graphs, and nothing is captured while serving. Before graph capture ran
under inference mode, a gateway on a GPU never became ready; this is that start, on CPU.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.tts.batched import BatchedQwenEngine, batch_buckets
from gateway.tts.graphs import StandInGraph
from tests.support.servers import AUTH_TOKEN, VirtualServer, on_virtual_time, serve_virtual
from tests.support.twilio_client import FakeTwilioCall


@pytest.fixture(scope="module")
def graph_gateway(tiny_model_dir: Path) -> Iterator[VirtualServer]:
    with serve_virtual({"model": str(tiny_model_dir), "cuda_graphs": "on", "batch_rows": 4,
                        "max_seq_len": 512}) as live:
        yield live


def _engine(live: VirtualServer) -> BatchedQwenEngine:
    engine = live.gateway.speech_service.engines[0]
    assert isinstance(engine, BatchedQwenEngine)
    return engine


@on_virtual_time("graph_gateway")
async def test_a_gateway_in_graph_mode_becomes_ready_with_every_graph_captured(
    graph_gateway: VirtualServer,
) -> None:
    async with httpx.AsyncClient(base_url=graph_gateway.base_url, timeout=10) as client:
        ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert "graph stand-in" in ready.json()["engine"]
    engine = _engine(graph_gateway)
    # Buckets 1, 2, 4 x attended lengths 256, 512: all captured at warm-up.
    assert engine.captures == len(batch_buckets(4)) * 2 == len(engine._graphs)
    assert all(isinstance(graph, StandInGraph) for graph in engine._graphs.values())


@on_virtual_time("graph_gateway")
async def test_a_caller_in_graph_mode_is_greeted_and_answered_from_replayed_graphs(
    graph_gateway: VirtualServer,
) -> None:
    engine = _engine(graph_gateway)
    captured = engine.captures
    replays_before = sum(g.replays for g in engine._graphs.values())
    async with FakeTwilioCall(graph_gateway.ws_url, AUTH_TOKEN, call_sid="CA" + "9" * 32,
                              stream_sid="MZ" + "9" * 32) as call:
        await call.start()
        await call.wait_for(lambda: call.events("media"), timeout=60)
        server_call = graph_gateway.gateway.registry[call.call_sid]
        await call.wait_for(lambda: call.events("mark"), timeout=120)
        await call.send_dtmf("7")
        reply = await call.wait_for(
            lambda: len(server_call.utterances) > 1 and server_call.utterances[1], timeout=30)
        assert "seven" in reply.text  # the greeter reads the key back in words
        await call.wait_for(
            lambda: [r for r in call.events("mark") if r.message["mark"]["name"] == reply.id],
            timeout=120)
        frames = sum(len(base64.b64decode(r.message["media"]["payload"])) // 160
                     for r in call.events("media"))
        assert frames == sum(u.frames_sent for u in server_call.utterances) > 0
        await call.send_stop()
    assert engine.captures == captured  # nothing captured while serving
    assert sum(g.replays for g in engine._graphs.values()) > replays_before

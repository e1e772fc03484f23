"""Shared fixtures: the tiny checkpoint and a real gateway server on an ephemeral port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from gateway.app import GatewayState, create_app
from gateway.config import Settings

AUTH_TOKEN = "test-auth-token-0123456789abcdef"

# Two cores on CI: keep torch from oversubscribing them while the server and client share them.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU-marked tests only when no CUDA device exists (CPU twins cover the behaviour)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; covered on CPU by the tiny model")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight CustomVoice checkpoint of the real architecture (built once)."""
    from gateway.tts.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "custom_voice")


@pytest.fixture(scope="session")
def tiny_base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Base (voice-clone) checkpoint."""
    from gateway.tts.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "base", kind="base")


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """The real QwenEngine over the tiny checkpoint, on CPU."""
    from gateway.tts.qwen import QwenEngine

    engine = QwenEngine(model=str(tiny_model_dir), device="cpu")
    engine.warmup()
    return engine


@dataclass
class LiveServer:
    """A gateway served by uvicorn on 127.0.0.1 in a background thread."""

    base_url: str
    ws_url: str
    state: GatewayState
    server: uvicorn.Server


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serve(settings_overrides: dict[str, object], engine_factory=None) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    """Run a real gateway until the block exits; waits for /readyz first."""
    sock = _free_socket()
    port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    values: dict[str, object] = {
        "twilio_auth_token": AUTH_TOKEN,
        "public_url": base_url,
        "device": "cpu",
    }
    values.update(settings_overrides)
    settings = Settings(**values)  # type: ignore[arg-type]
    app = create_app(settings, engine_factory) if engine_factory else create_app(settings)
    config = uvicorn.Config(
        app, log_level="warning", ws_max_size=settings.ws_max_size, lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    state: GatewayState = app.state.gateway
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if state.load_error:
                raise RuntimeError(state.load_error)
            try:
                if httpx.get(f"{base_url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError("gateway did not become ready in 120 s")
        yield LiveServer(base_url, f"ws://127.0.0.1:{port}/twilio/media", state, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def live_gateway(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """One real gateway (tiny model on CPU) shared by a test module."""
    with serve({"model": str(tiny_model_dir)}) as live:
        yield live


DEMO_SCRIPT = Path(__file__).resolve().parent.parent / "prompts" / "demo.yaml"


@pytest.fixture(scope="session")
def demo_cache_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The demo script's static prompts rendered once per run into an on-disk cache, exactly as
    ``gateway prompts render`` does; servers and runner tests in this run start from it."""
    from gateway.cli import main

    cache = tmp_path_factory.mktemp("prompt-cache")
    code = main(
        [
            "prompts",
            "render",
            str(DEMO_SCRIPT),
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--cache-dir",
            str(cache),
        ]
    )
    assert code == 0
    return cache


@contextlib.contextmanager
def backend() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The company's account service: POST /accounts/lookup."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    @app.post("/accounts/lookup")
    async def lookup(body: dict[str, Any]) -> dict[str, str]:
        seen.append(body)
        account = body["variables"]["account_number"]
        return {"first_name": "Dana", "balance": f"{int(account) % 1000}.10", "due_date": "March 3"}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started:
        time.sleep(0.01)
    try:
        yield url, seen
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()

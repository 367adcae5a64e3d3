"""Real servers for the server tests: the application under uvicorn on 127.0.0.1 (an ephemeral
port), in a thread of the test process so a test can also look inside the server; the engine
runs in its own process, as under `dspark serve`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from dspark.config import EngineConfig  # noqa: E402
from dspark.server.app import build_app  # noqa: E402
from dspark.server.config import ServerConfig  # noqa: E402
from dspark.server.engine_process import engine_factory  # noqa: E402
from tests.tiny_models import make_tiny_drafter, make_tiny_llama  # noqa: E402

API_KEY = "test-key"
MODEL = "tiny"


class LiveServer:
    """uvicorn serving `app` until stop(); `url` is its base URL."""

    def __init__(self, app) -> None:
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                timeout_graceful_shutdown=5)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    @property
    def tokenizer(self):
        return self.state.engine_loop.info.tokenizer

    @property
    def stats(self):
        """The engine's stats after its last step."""
        return self.state.engine_loop.stats

    def assert_pages_free(self) -> None:
        stats = self.stats
        assert stats.num_kv_pages_used == 0, f"{stats.num_kv_pages_used} KV pages still used"

    def start(self, wait_healthy: bool = True) -> LiveServer:
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn failed to start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if wait_healthy:
            health = self.wait_for_health(200)
            assert health.status_code == 200, health.text
        return self

    def wait_for_health(self, status: int, timeout: float = 60.0) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while True:
            response = httpx.get(f"{self.url}/health")
            is_dead = response.json().get("status") == "dead"
            if response.status_code == status or is_dead or time.monotonic() > deadline:
                return response
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine has nothing left and the server routes no request."""
        deadline = time.monotonic() + timeout
        loop = self.state.engine_loop
        while loop.num_in_flight or loop.stats.num_running or loop.stats.num_waiting:
            assert time.monotonic() < deadline, "the server did not become idle"
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server; its engine process must have exited with it."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        process = self.state.engine_loop.process
        if process is not None:  # (a slow machine may still be tearing it down)
            process.join(timeout=15)
        assert process is None or not process.is_alive(), "the engine process outlived the server"


def is_running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def engine_config(model_dir, **overrides) -> EngineConfig:
    kwargs = dict(model=str(model_dir), dtype="float32", device="cpu", num_kv_pages=512,
                  max_model_len=128)  # fmt: skip
    return EngineConfig(**(kwargs | overrides))


def start_server(config: EngineConfig, **server_overrides) -> LiveServer:
    server_config = ServerConfig(**({"served_model_name": MODEL} | server_overrides))
    return LiveServer(build_app(server_config, engine_factory(config))).start()


@pytest.fixture(scope="session")
def long_llama_dir(tmp_path_factory, smollm_hf_tokenizer):
    """The tiny Llama with a 4096-token context: requests that run for seconds."""
    directory = tmp_path_factory.mktemp("long_llama")
    return make_tiny_llama(directory, smollm_hf_tokenizer, max_position_embeddings=4096)


@pytest.fixture(scope="session")
def server(tiny_llama_dir):
    """Plain decoding, an API key, max_model_len 128, room for 256 requests at once."""
    live = start_server(engine_config(tiny_llama_dir), api_key=API_KEY)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def server_drafter(tiny_llama_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_llama_dir, tmp_path_factory.mktemp("server_drafter"), (0, 1))


@pytest.fixture(scope="session")
def spec_server(tiny_llama_dir, server_drafter):
    """The same target with a fixed-K DSpark drafter (K 4), and its whole 512-token context
    (real benchmark prompts fit)."""
    spec = {"method": "dspark", "model": str(server_drafter), "num_speculative_tokens": 4}
    config = engine_config(tiny_llama_dir, speculative_config=spec, max_model_len=512)
    live = start_server(config, api_key=API_KEY)
    yield live
    live.stop()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}

"""The CLI as an operator meets it: a busy port fails at once, logs are quiet and can be JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp import web

from deepinfer.cli import main
from deepinfer.config import LogConfig, ServerConfig
from deepinfer.engine import llm_engine
from deepinfer.logger import formatter
from deepinfer.server.access_log import app_runner
from deepinfer.server.protocol import NodeHeartbeat, NodeLoad


@pytest.mark.parametrize(("command", "section"), [("serve", "server"), ("node", "node")])
def test_a_busy_port_fails_before_the_model_loads(
    command: str,
    section: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    loads = []

    def no_engine(self: object, *args: object, **kwargs: object) -> None:
        loads.append(args)
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_engine)
    monkeypatch.chdir(tmp_path)  # no config.toml
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main([command, "--port", str(port), "--device", "cpu"]) == 2
    assert loads == []  # no weights were loaded
    assert capsys.readouterr().err == (
        f"deepinfer {command}: error: cannot listen on 127.0.0.1:{port} "
        f"({section}.host, {section}.port): Address already in use\n"
    )


@pytest.mark.asyncio
async def test_probes_and_heartbeats_log_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    from coordinator_fakes import TOKENIZER_PATH

    from deepinfer.server.coordinator import create_coordinator_app

    app = create_coordinator_app(
        ServerConfig(), tokenizer_path=TOKENIZER_PATH, served_model_name="m"
    )
    runner = app_runner(app)  # what serve, node and coordinator run their apps with
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    heartbeat = msgspec.msgpack.encode(NodeHeartbeat(node_id="n1", load=NodeLoad()))
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            for level in (logging.INFO, logging.DEBUG):
                with caplog.at_level(level, logger="aiohttp.access"):
                    caplog.clear()
                    for path in ("/health", "/ready", "/metrics"):
                        (await session.get(path)).release()
                    (await session.post("/internal/heartbeat", data=heartbeat)).release()
                    (await session.get("/v1/models")).release()
                    await asyncio.sleep(0.05)  # the access log is written after the response
                lines = [r.getMessage().split('"')[1] for r in caplog.records]
                expected = ["GET /v1/models"]
                if level == logging.DEBUG:
                    probes = ["GET /health", "GET /ready", "GET /metrics"]
                    expected = [*probes, "POST /internal/heartbeat", *expected]
                assert lines == expected
    finally:
        await runner.cleanup()


def test_json_log_lines() -> None:
    record = logging.LogRecord("deepinfer.x", logging.WARNING, __file__, 1, "a %s", ("b",), None)
    line = json.loads(formatter("json").format(record))
    assert {k: line[k] for k in ("level", "logger", "message")} == {
        "level": "WARNING", "logger": "deepinfer.x", "message": "a b"
    }  # fmt: skip
    assert line["timestamp"].endswith("+00:00")
    assert LogConfig(level="debug", format="json").level == "DEBUG"
    with pytest.raises(ValueError, match=r"log\.format must be one of"):
        LogConfig(format="xml")

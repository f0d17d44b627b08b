"""The control plane on real processes: a coordinator and two nodes started as the deploy/
examples configure them (deploy/config.example.toml, the variables of
deploy/systemd/deepinfer.env.example), one node with the right node token and one with a wrong
one, and an attacker on the network without the token.

The internal endpoints are 404 on the public port and 401 without the token on the internal
listener; a registration may not take a static node's id, nor a heartbeat speak for another
node; nothing starts on a non-loopback address without the token; and no secret appears in any
process's log.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from processes import Process, clean_env, free_port, http_status, post

from deepinfer.model.tiny import make_tiny_model
from deepinfer.server.protocol import NodeHeartbeat, NodeLoad, NodeRegistration

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
EXAMPLE_CONFIG = DEPLOY / "config.example.toml"


def _example_env(values: dict[str, str]) -> dict[str, str]:
    """The commented-out variables of the env example that ``values`` names, uncommented, with
    ``values``' values: the names the deploy/ files document are the names the code reads."""
    text = (DEPLOY / "systemd" / "deepinfer.env.example").read_text(encoding="utf-8")
    documented = set(re.findall(r"(?m)^#(DEEPINFER_[A-Z_]+)=", text))
    assert set(values) <= documented, sorted(set(values) - documented)
    return values


@dataclass
class Cluster:
    public: str  # http://127.0.0.1:<server.port>
    internal: str  # http://127.0.0.1:<server.internal_port>
    node_id: str  # the good node's
    node_token: str
    wrong_token: str
    api_keys: list[str]
    coordinator: Process
    node: Process
    intruder: Process  # a node with a wrong token

    @property
    def processes(self) -> list[Process]:
        return [self.coordinator, self.node, self.intruder]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("control-plane")
    model = make_tiny_model(tmp / "deepinfer-tiny")
    port, internal_port, node_port, intruder_port = (free_port() for _ in range(4))
    node_token, wrong_token = secrets.token_hex(16), secrets.token_hex(16)
    api_keys = [f"sk-{secrets.token_hex(8)}", f"sk-{secrets.token_hex(8)}"]
    shared = _example_env(
        {
            "DEEPINFER_SERVER_API_KEYS": ",".join(api_keys),
            "DEEPINFER_SERVER_NODE_TOKEN": node_token,
            "DEEPINFER_NODE_COORDINATOR_INTERNAL_URL": f"http://127.0.0.1:{internal_port}",
            "DEEPINFER_MODEL_PATH": str(model),
            "DEEPINFER_CACHE_DISK_TIER_DIR": "",  # the example's /var/cache is not ours here
        }
    )
    # This machine's stand-ins for the production sizes of config.example.toml.
    cpu = {
        "DEEPINFER_MODEL_DEVICE": "cpu",
        "DEEPINFER_CACHE_NUM_BLOCKS": "32",
        "DEEPINFER_CACHE_HOST_TIER_GIB": "0",
    }
    env = clean_env(XDG_CACHE_HOME=str(tmp / "xdg"), **shared, **cpu)
    config = ["--config", str(EXAMPLE_CONFIG)]
    processes = []
    try:
        coordinator = Process.start(
            ["coordinator", *config, "--host", "127.0.0.1", "--port", str(port),
             "--internal-port", str(internal_port),
             "--node", f"http://127.0.0.1:{node_port}", "--max-model-len", "8192"],
            env, tmp / "coordinator.log", tmp,
        )  # fmt: skip
        processes.append(coordinator)
        # As deepinfer-node@N.service starts it: only --port on the command line.
        node = Process.start(
            ["node", *config, "--port", str(node_port)], env, tmp / "node.log", tmp
        )
        processes.append(node)
        intruder_env = {**env, "DEEPINFER_SERVER_NODE_TOKEN": wrong_token}
        intruder_env["DEEPINFER_NODE_NODE_ID"] = "intruder"
        intruder = Process.start(
            ["node", *config, "--port", str(intruder_port)], intruder_env, tmp / "intruder.log", tmp
        )
        processes.append(intruder)
        public = f"http://127.0.0.1:{port}"
        coordinator.wait_for(f"{public}/health")
        internal = f"http://127.0.0.1:{internal_port}"
        node_id = f"{socket.gethostname()}:{node_port}"
        node.wait_for_log(f"registered as {node_id!r} with coordinator {internal}")
        intruder.wait_for_log(
            f"registration with coordinator {internal} failed (HTTP 401 Unauthorized)"
        )
        yield Cluster(
            public, internal, node_id, node_token, wrong_token, api_keys, coordinator, node,
            intruder,
        )  # fmt: skip
    finally:
        for process in processes:
            process.stop()


def _ready_nodes(cluster: Cluster, expected: int | None = None) -> int:
    """Nodes in rotation; with ``expected``, once that many are (static nodes are probed into
    rotation: one that was still loading when first probed joins at the next probe)."""
    deadline = time.monotonic() + 10.0
    while True:
        with urllib.request.urlopen(f"{cluster.public}/ready", timeout=10) as response:
            num_ready = json.loads(response.read())["num_ready_nodes"]
        if expected is None or num_ready == expected or time.monotonic() > deadline:
            return num_ready
        time.sleep(0.1)


def _registration(node_id: str, url: str) -> bytes:
    registration = NodeRegistration(
        node_id=node_id, url=url, role="mixed", model="deepinfer-tiny", max_model_len=8192
    )
    return msgspec.json.encode(registration)


def _json_headers(token: str | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def test_nodes_from_the_deploy_examples_register(cluster: Cluster) -> None:
    # static-0 (--node) and the node that registered; never the one with the wrong token.
    assert _ready_nodes(cluster, expected=2) == 2
    assert f"node {cluster.node_id} registered: http://" in cluster.coordinator.log
    body = {
        "model": "deepinfer-tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,  # greedy: sampled, the tiny model's EOS may end the reply early
        "thinking": {"type": "disabled"},
    }
    url = f"{cluster.public}/v1/chat/completions"
    status, reply = post(url, json.dumps(body).encode(), _json_headers(cluster.api_keys[1]))
    assert (status, reply["usage"]["completion_tokens"]) == (200, 4)
    status, reply = post(url, json.dumps(body).encode(), _json_headers(cluster.node_token))
    assert (status, reply["error"]["code"]) == (401, "invalid_api_key")


@pytest.mark.parametrize("path", ["/internal/register", "/internal/heartbeat"])
def test_internal_endpoints_are_404_on_the_public_port(cluster: Cluster, path: str) -> None:
    body = _registration("attacker", "http://10.6.6.6:8100")
    for token in (None, cluster.node_token):
        status, _ = post(f"{cluster.public}{path}", body, _json_headers(token))
        assert status == 404
    assert _ready_nodes(cluster, expected=2) == 2


def test_the_internal_listener_needs_the_node_token(cluster: Cluster) -> None:
    for path in ("/internal/register", "/internal/heartbeat"):
        for token in (None, cluster.wrong_token, cluster.api_keys[0]):
            body = _registration("attacker", "http://10.6.6.6:8100")
            status, reply = post(f"{cluster.internal}{path}", body, _json_headers(token))
            assert (status, reply["error"]["message"]) == (
                401,
                "Authentication failed: wrong or missing node token",
            )
    assert _ready_nodes(cluster, expected=2) == 2


def test_a_static_node_cannot_be_replaced(cluster: Cluster) -> None:
    body = _registration("static-0", "http://10.6.6.6:8100")
    headers = _json_headers(cluster.node_token)
    status, reply = post(f"{cluster.internal}/internal/register", body, headers)
    assert (status, reply["error"]["message"]) == (
        409,
        "Registration refused: node id 'static-0' belongs to a static node",
    )
    body = _registration(cluster.node_id, "http://10.6.6.6:8100")  # a live node's id
    status, reply = post(f"{cluster.internal}/internal/register", body, headers)
    assert status == 409 and "is held by a live node at another URL" in reply["error"]["message"]
    assert _ready_nodes(cluster, expected=2) == 2


def test_a_heartbeat_for_another_nodes_id_is_refused(cluster: Cluster) -> None:
    for lease_id in ("", "guess"):
        beat = NodeHeartbeat(
            node_id=cluster.node_id, load=NodeLoad(is_draining=True), lease_id=lease_id
        )
        status, reply = post(
            f"{cluster.internal}/internal/heartbeat",
            msgspec.json.encode(beat),
            _json_headers(cluster.node_token),
        )
        assert (status, reply["error"]["message"]) == (
            403,
            f"This heartbeat does not carry node {cluster.node_id!r}'s lease; register",
        )
    assert _ready_nodes(cluster, expected=2) == 2  # still in rotation, not draining


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["coordinator", "--internal-host", "0.0.0.0"],
            "deepinfer coordinator: error: server.internal_host = '0.0.0.0' is not a loopback "
            "address: set server.node_token",
        ),
        (
            ["node", "--host", "0.0.0.0", "--device", "cpu"],
            "deepinfer node: error: node.host = '0.0.0.0' is not a loopback address: set "
            "server.node_token",
        ),
    ],
    ids=["coordinator", "node"],
)
def test_no_listener_beyond_loopback_without_the_token(
    args: list[str], message: str, tmp_path: Path
) -> None:
    ports = ["--port", str(free_port())]
    process = Process.start([*args, *ports], clean_env(), tmp_path / "log", tmp_path)
    assert process.popen.wait(timeout=30) == 2
    assert message in process.log
    assert http_status(f"http://127.0.0.1:{ports[1]}/health") is None


def test_no_secret_in_any_log_line(cluster: Cluster) -> None:
    """Every process logged what it did (registrations, refusals, a rejected node's retries);
    none logged the node token, the wrong token or an API key."""
    cluster.intruder.wait_for_log("retrying in 4.0 s")  # its third refused registration
    assert "registration of node 'static-0'" in cluster.coordinator.log
    for process in cluster.processes:
        log = process.log
        assert log.count("\n") > 3, log
        for secret in (cluster.node_token, cluster.wrong_token, *cluster.api_keys):
            assert secret not in log, (process.log_path.name, secret)

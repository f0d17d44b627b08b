"""Deployment: the systemd units, sd_notify (server/systemd.py), the Grafana dashboard, and real
`deepinfer serve|node|coordinator` processes reporting READY=1 / STOPPING=1 to a notify socket.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import logging
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from processes import free_port, http_status

from deepinfer.config import Config
from deepinfer.server import systemd
from deepinfer.server.metrics import CoordinatorMetrics
from deepinfer.server.node_metrics import NodeMetrics
from deepinfer.server.protocol import NodeLoad

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
UNITS = {
    "deepinfer-serve.service": "serve",
    "deepinfer-coordinator.service": "coordinator",
    "deepinfer-node@.service": "node",
}
DEEPINFER_BIN = "/opt/deepinfer/.venv/bin/deepinfer"


# -- unit files ----------------------------------------------------------------------------------


class _MultiDict(dict):
    """configparser section storage that keeps every value of a repeated key (systemd allows
    ``Environment=`` many times; plain configparser keeps the last). While reading, configparser
    stores each value as a list; extending it here joins repeats as lines."""

    def __setitem__(self, key: str, value: object) -> None:
        if isinstance(value, list) and isinstance(self.get(key), list):
            self[key].extend(value)
        else:
            super().__setitem__(key, value)


def _parse_unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(
        strict=False, interpolation=None, dict_type=_MultiDict, empty_lines_in_values=False
    )
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(path, encoding="utf-8")
    return parser


def _seconds(value: str) -> float:
    """A systemd time span as the units write it: "90s", "30min", "2min"."""
    match = re.fullmatch(r"(\d+)(s|min)", value)
    assert match, f"unexpected time span {value!r}"
    return int(match[1]) * (60 if match[2] == "min" else 1)


@pytest.fixture(scope="module")
def example_config() -> Config:
    return Config.load(DEPLOY / "config.example.toml", environ={})


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_unit_has_the_required_keys(unit: str, example_config: Config) -> None:
    parsed = _parse_unit(DEPLOY / "systemd" / unit)
    service = parsed["Service"]
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "KillSignal": "SIGTERM",
        "Restart": "on-failure",
        "User": "deepinfer",
        "StandardOutput": "journal",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "LockPersonality": "yes",
        "RestrictRealtime": "yes",
        "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
    }
    assert {key: service.get(key) for key in expected} == expected
    for key in ("WatchdogSec", "TimeoutStartSec", "TimeoutStopSec", "RestartSec"):
        assert _seconds(service[key]) > 0, key
    assert service["SyslogIdentifier"].startswith("deepinfer-")
    assert "-/etc/deepinfer/deepinfer.env" in service["EnvironmentFile"].splitlines()
    assert "MemoryDenyWriteExecute" not in service  # Triton/torch JIT need W+X pages
    command = UNITS[unit]
    assert f"{DEEPINFER_BIN} {command} --config /etc/deepinfer/config.toml" in service["ExecStart"]
    # TimeoutStopSec covers the drain grace with margin (the node also stops its engine, 10 s).
    if command == "node":
        assert "PrivateDevices" not in service  # it would hide /dev/nvidia*
        grace = example_config.node.drain_timeout_s + 10.0
    else:
        grace = example_config.server.drain_timeout_s
    assert _seconds(service["TimeoutStopSec"]) >= grace + 15.0
    if command == "serve":
        assert "PrivateDevices" not in service
    assert parsed["Install"]["WantedBy"] == "multi-user.target"


def test_node_template_maps_instance_to_accelerator_and_port() -> None:
    service = _parse_unit(DEPLOY / "systemd" / "deepinfer-node@.service")["Service"]
    environment = service["Environment"].splitlines()
    assert "CUDA_VISIBLE_DEVICES=%i" in environment
    assert "ASCEND_RT_VISIBLE_DEVICES=%i" in environment
    assert "-/etc/deepinfer/node-%i.env" in service["EnvironmentFile"].splitlines()
    # Run ExecStart's shell as systemd would for deepinfer-node@3 ($$ is a literal $, %i the
    # instance), with `echo` in place of deepinfer, to read the port it computes.
    # A lone $ would be systemd's own ${VAR} expansion, which knows no ${VAR:-default}.
    assert "$" not in service["ExecStart"].replace("$$", "")
    argv = shlex.split(service["ExecStart"].replace("$$", "$").replace("%i", "3"))
    assert argv[:2] == ["/bin/sh", "-c"]
    script = argv[2].replace(DEEPINFER_BIN, "echo")
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_NODE_PORT"}
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True)
    assert out.stdout == "node --config /etc/deepinfer/config.toml --port 8103\n"
    env["DEEPINFER_NODE_PORT"] = "9000"
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True)
    assert out.stdout == "node --config /etc/deepinfer/config.toml --port 9000\n"


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    # The venv's binary (/opt/deepinfer/.venv/bin/deepinfer) does not exist here and verify
    # rejects a missing ExecStart binary: then the copy runs /bin/true instead (the node's
    # ExecStart is /bin/sh, verified as written). User= is dropped when this machine has no
    # deepinfer user. Everything else is verified as written.
    text = (DEPLOY / "systemd" / unit).read_text(encoding="utf-8")
    binary = re.search(r"(?m)^ExecStart=(\S+)", text)
    assert binary is not None
    if not os.access(binary[1], os.X_OK):
        text = re.sub(r"(?m)^ExecStart=.*$", "ExecStart=/bin/true", text)
    try:
        pwd.getpwnam("deepinfer")
    except KeyError:
        text = re.sub(r"(?m)^User=.*\n", "", text)
    name = unit.replace("@.", "@0.")  # a template is verified as an instance
    (tmp_path / name).write_text(text, encoding="utf-8")
    result = subprocess.run(
        [analyze, "verify", f"./{name}"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    # verify exits 0 on unknown keys and unparsable values (it only warns): any line about our
    # file is a failure.
    about_unit = [line for line in result.stderr.splitlines() if name in line]
    assert (result.returncode, about_unit) == (0, []), result.stderr


def test_ranks_target_starts_and_stops_the_ranks_together(tmp_path: Path) -> None:
    """deepinfer-ranks.target wants node@0..7; the drop-in makes each node PartOf= it (so stop
    and restart propagate), and documents the [parallel] variables a rank needs."""
    target = _parse_unit(DEPLOY / "systemd" / "deepinfer-ranks.target")
    wants = " ".join(target["Unit"]["Wants"].splitlines()).split()
    assert wants == [f"deepinfer-node@{i}.service" for i in range(8)]
    assert target["Install"]["WantedBy"] == "multi-user.target"
    drop_in = DEPLOY / "systemd" / "deepinfer-node@.service.d" / "ranks.conf"
    assert _parse_unit(drop_in)["Unit"]["PartOf"] == "deepinfer-ranks.target"
    text = drop_in.read_text(encoding="utf-8")
    for key in ("DATA_PARALLEL_RANK=N", "DATA_PARALLEL_SIZE=", "DATA_PARALLEL_MASTER_PORT="):
        assert f"DEEPINFER_PARALLEL_{key}" in text
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    (tmp_path / "deepinfer-ranks.target").write_text(
        (DEPLOY / "systemd" / "deepinfer-ranks.target").read_text(encoding="utf-8")
    )
    result = subprocess.run(
        [analyze, "verify", "./deepinfer-ranks.target"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    about = [line for line in result.stderr.splitlines() if "deepinfer-ranks.target" in line]
    assert (result.returncode, about) == (0, []), result.stderr


def test_example_config_loads(example_config: Config) -> None:
    assert example_config.server.host == "0.0.0.0"
    assert example_config.cache.disk_tier_dir == "/var/cache/deepinfer/kv"  # CacheDirectory=
    assert example_config.node.max_step_s < 60.0  # below the units' WatchdogSec


# -- sd_notify -----------------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A unix datagram socket standing in for systemd's, named by $NOTIFY_SOCKET."""
    path = tmp_path / "notify"
    assert len(str(path)) < 100, f"unix socket path too long: {path}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield sock
    sock.close()


def _received(sock: socket.socket) -> list[bytes]:
    datagrams = []
    while True:
        try:
            datagrams.append(sock.recv(4096))
        except BlockingIOError:
            return datagrams


def test_ready_stopping_status_send_exact_datagrams(notify_socket: socket.socket) -> None:
    assert systemd.ready()
    assert systemd.status("serving\non :8000")
    assert systemd.stopping()
    assert systemd.notify("RELOADING=1\nMONOTONIC_USEC=1")
    assert _received(notify_socket) == [
        b"READY=1",
        b"STATUS=serving on :8000",
        b"STOPPING=1",
        b"RELOADING=1\nMONOTONIC_USEC=1",
    ]


def test_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"deepinfer-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.ready()
        assert _received(sock) == [b"READY=1"]


def test_everything_is_a_no_op_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(var, raising=False)
    assert (systemd.ready(), systemd.stopping(), systemd.status("x")) == (False, False, False)
    assert systemd.notify("WATCHDOG=1") is False
    assert systemd.watchdog_interval() is None
    calls = []
    # Returns at once (no watchdog expected), never asking for health.
    asyncio.run(asyncio.wait_for(systemd.watchdog_loop(lambda: calls.append(1) or True), 1.0))
    assert calls == []


def test_send_failure_returns_false_and_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    with caplog.at_level(logging.WARNING, logger="deepinfer.server.systemd"):
        assert systemd.ready() is False
    assert "sd_notify 'READY=1'" in caplog.text


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("200000", None, 0.2),
        ("200000", "self", 0.2),
        ("200000", "other", None),
        ("0", None, None),
        ("soon", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval(
    usec: str | None, pid: str | None, expected: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(var, value)
    assert systemd.watchdog_interval() == expected


async def _wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_watchdog_pings_only_while_healthy(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "40000")  # 40 ms: a ping every 20 ms
    checks: list[bool] = []
    is_healthy = True

    def check() -> bool:
        checks.append(is_healthy)
        return is_healthy

    async with systemd.watchdog(check):
        await _wait_for(lambda: len(checks) >= 3)
        await asyncio.sleep(0)
        pings = _received(notify_socket)
        assert pings == [b"WATCHDOG=1"] * len(pings) and len(pings) >= 3
        is_healthy = False  # no await since the drain above: every later check sees False
        num_checked = len(checks)
        await _wait_for(lambda: len(checks) >= num_checked + 4)
        assert _received(notify_socket) == []
        is_healthy = True
        await _wait_for(lambda: len(_received(notify_socket)) > 0, timeout_s=1.0)
    await asyncio.sleep(0.1)  # five periods: the task is gone
    assert _received(notify_socket) == []


@pytest.mark.asyncio
async def test_watchdog_treats_a_raising_check_as_unhealthy(
    notify_socket: socket.socket,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    calls = []

    def check() -> bool:
        calls.append(1)
        raise RuntimeError("engine gone")

    with caplog.at_level(logging.ERROR, logger="deepinfer.server.systemd"):
        async with systemd.watchdog(check):
            await _wait_for(lambda: len(calls) >= 3)
    assert _received(notify_socket) == []
    assert "the health check raised" in caplog.text and "engine gone" in caplog.text


# -- Grafana dashboard ---------------------------------------------------------------------------

# What prometheus_client exports for each metric family type.
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# Every identifier a dashboard expression may use besides metric names.
_PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "ignoring", "on", "group_left", "group_right", "and", "or", "unless",
    "clamp_min", "label_values",
}  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|ignoring|on|group_left|group_right)\s*\([^)]*\)")


def _exported_metric_names() -> set[str]:
    from deepinfer.kv_cache.tiers import TierStats

    coordinator = CoordinatorMetrics("m")
    node = NodeMetrics("n", "m", 4096, NodeLoad)
    # The tier/prefix families are produced at scrape time from the engine's cache_stats().
    stats = {
        "prefix_query_tokens": 0,
        "evicted_blocks": 0,
        "replayed_tokens": 0,
        "cached_tokens_by_tier": {"device": 0},
        "snapshots_stored": 0,
        "snapshots_restored": 0,
        "snapshots_evicted": 0,
        "tiers": {"host": TierStats()},
    }
    node.watch_cache(lambda: stats)
    node.watch_graphs(lambda: {"startup": 1, "serving": 0})
    names = set()
    for registry in (coordinator.registry, node.registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def _expressions(dashboard: dict) -> list[str]:
    return [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def _referenced_names(expr: str) -> set[str]:
    """Identifiers of ``expr`` outside label matchers, ranges and grouping clauses."""
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    stripped = re.sub(r'"[^"]*"', "", expr)
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", stripped)
    stripped = _GROUPING.sub(" ", stripped)
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped)) - _PROMQL_WORDS


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "deepinfer-dashboard.json").read_text("utf-8"))


def test_dashboard_uses_only_exported_metrics(dashboard: dict) -> None:
    exported = _exported_metric_names()
    assert "deepinfer_time_to_first_token_seconds_bucket" in exported
    assert "deepinfer_prefix_cache_hits_total" in exported
    expressions = _expressions(dashboard)
    assert len(expressions) >= 20
    used = set()
    for expr in expressions:
        names = _referenced_names(expr)
        assert names and names <= exported, (expr, sorted(names - exported))
        used |= names
    queries = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for query in queries:
        assert _referenced_names(query) - {"node", "model_name"} <= exported, query
    for metric in (
        "deepinfer_finished_requests_total",
        "deepinfer_iteration_tokens_bucket",
        "deepinfer_request_prompt_tokens_bucket",
        "deepinfer_request_generation_tokens_bucket",
        "deepinfer_request_prefill_time_seconds_bucket",
        "deepinfer_request_decode_time_seconds_bucket",
        "deepinfer_time_to_first_token_seconds_bucket",
        "deepinfer_inter_token_latency_seconds_bucket",
        "deepinfer_e2e_request_latency_seconds_bucket",
        "deepinfer_request_queue_time_seconds_bucket",
        "deepinfer_admission_rejections_total",
        "deepinfer_kv_cache_usage_ratio",
        "deepinfer_prefix_cache_hits_total",
        "deepinfer_prefix_cache_queries_total",
        "deepinfer_preemptions_total",
        "deepinfer_kv_tier_bytes_total",
    ):
        assert metric in used, f"no panel shows {metric}"


def test_dashboard_structure(dashboard: dict) -> None:
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), sorted(ids)
    assert dashboard["schemaVersion"] == 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert {"node", "model_name"} <= variables.keys()
    for name in ("node", "model_name"):
        assert variables[name]["allValue"] == ".+"
    # Coordinator and node share family names (server/metrics.py): every selector names its
    # component, the coordinator's filtered by model, the nodes' by node.
    by_component = {"coordinator": "$model_name", "node": "$node"}
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            for target in panel["targets"]:
                selectors = re.findall(r"\{([^}]*)\}", target["expr"].replace("{{", ""))
                assert selectors, target["expr"]
                for selector in selectors:
                    if selector.startswith("le"):
                        continue
                    component = re.match(r'component="(\w+)", ', selector)
                    assert component and by_component[component[1]] in selector, selector


# -- real processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xdg_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the first process builds the tiny model there (about 1 s)."""
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.mark.parametrize(
    ("command", "ready_path", "expected"),
    [
        (
            "serve",
            "/ready",
            [
                "STATUS=loading the model",
                "READY=1",
                "STATUS=serving deepinfer-tiny on http://127.0.0.1:{port}",
                "STOPPING=1",
                "STATUS=draining: in-flight requests get 60 s",
            ],
        ),
        (
            "node",
            "/ready",
            [
                "STATUS=loading the model",
                "READY=1",
                "STATUS=serving on http://127.0.0.1:{port}",
                "STOPPING=1",
                "STATUS=draining: in-flight requests get 30 s",
            ],
        ),
        (
            # No node in rotation, so /ready stays 503: /health says it listens.
            "coordinator",
            "/health",
            [
                "READY=1",
                "STATUS=serving deepinfer-tiny on http://127.0.0.1:{port}",
                "STOPPING=1",
                "STATUS=draining: in-flight requests get 60 s",
            ],
        ),
    ],
    ids=["serve", "node", "coordinator"],
)
def test_process_notifies_ready_and_stopping(
    command: str,
    ready_path: str,
    expected: list[str],
    notify_socket: socket.socket,
    xdg_cache_home: Path,
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(xdg_cache_home),
        "WATCHDOG_USEC": "500000",  # a ping every 0.25 s
    }
    env = {k: v for k, v in env.items() if not k.startswith("DEEPINFER_")}
    internal_port = free_port()
    argv = [sys.executable, "-m", "deepinfer.cli", command, "--port", str(port)]
    if command != "node":  # serve runs the internal listener too, so remote nodes can join
        argv += ["--internal-port", str(internal_port)]
    if command != "coordinator":
        argv += ["--device", "cpu"]
    log_path = tmp_path / "process.log"
    with log_path.open("wb") as log:
        # cwd: a folder without config.toml, so that only the defaults apply.
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 45.0
        while http_status(f"http://127.0.0.1:{port}{ready_path}") != 200:
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.1)
        datagrams = _received(notify_socket)
        # Sent before the loop could answer any request.
        assert b"READY=1" in datagrams, datagrams
        internal_status = http_status(f"http://127.0.0.1:{internal_port}/health")
        assert internal_status == (None if command == "node" else 200)
        deadline = time.monotonic() + 5.0
        while b"WATCHDOG=1" not in datagrams:
            assert time.monotonic() < deadline, datagrams
            time.sleep(0.05)
            datagrams += _received(notify_socket)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15.0) == 0, log_path.read_text(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    datagrams += _received(notify_socket)
    messages = [d.decode() for d in datagrams if d != b"WATCHDOG=1"]
    assert messages == [line.format(port=port) for line in expected]

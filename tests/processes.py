"""Helpers for tests that run real `python -m deepinfer.cli ...` processes: free ports, a process
with its log in a file, polling an HTTP status until it is the expected one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without DEEPINFER_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def http_status(url: str, headers: dict[str, str] | None = None) -> int | None:
    """The status of a GET, None while nothing listens."""
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=2.0) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    """(status, JSON body) of a POST."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30.0) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@dataclass
class Process:
    """A `deepinfer` subcommand with its stdout and stderr in ``log_path``."""

    popen: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, args: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> Process:
        argv = [sys.executable, "-m", "deepinfer.cli", *args]
        with log_path.open("wb") as log:
            popen = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=log)
        return cls(popen, log_path)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, url: str, status: int = 200, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while http_status(url) != status:
            assert self.popen.poll() is None, self.log
            assert time.monotonic() < deadline, f"{url} never answered {status}:\n{self.log}"
            time.sleep(0.1)

    def wait_for_log(self, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log:
            assert self.popen.poll() is None, self.log
            assert time.monotonic() < deadline, f"{text!r} never logged:\n{self.log}"
            time.sleep(0.1)

    def peak_rss_mib(self) -> float:
        """VmHWM: the most resident memory the process ever had."""
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM in /proc/<pid>/status")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Cluster:
    """Server processes by name, each on a port of its own, logging into ``folder``; a
    subclass's ``start(name)`` builds each one's command line and calls ``launch``."""

    def __init__(self, folder: Path, model: Path, names: tuple[str, ...]) -> None:
        self.folder, self.model = folder, model
        self.ports = {name: free_port() for name in names}
        self.processes: dict[str, Process] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def launch(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = self.folder / f"{name}-{len(self.processes)}-{time.monotonic_ns()}.log"
        self.processes[name] = Process.start(args, env, log, self.folder)

    def wait_ready(self, *names: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            while http_status(self.url(name) + "/ready") != 200:
                assert self.processes[name].popen.poll() is None, self.logs()
                assert time.monotonic() < deadline, f"{name} not ready\n{self.logs()}"
                time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(f"== {n}\n{p.log[-3000:]}" for n, p in self.processes.items())

    def stop(self) -> None:
        for process in self.processes.values():
            if process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait()

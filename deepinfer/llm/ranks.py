"""The offline API over lock-step ranks: one process per rank, prompts spread, outputs gathered.

    LLM(config with data_parallel_size = N)
      -> RankPool: N processes (spawned; one per visible device, CPU: one thread each)
           rank_main(config of rank r): LLMEngine (joins the group) + EngineLoop
           parent <-> rank r over a pipe:
             -> ("generate", [(request id, prompt, params), ...])   every rank, even with none
             <- ("finished", RequestOutput) per request, then ("done", stats)
             <- ("error", message) when its group ended; the rank process then exits
      -> outputs in prompt order

Prompts go to the rank with the least work so far (prompt + max_tokens tokens). Every rank runs
every generate call in lock-step until no rank has requests left (engine/llm_engine.py). A rank
that fails, dies or hangs ends the group: the other ranks' collectives fail within
``parallel.collective_timeout_s`` (at once when its connection closes), the pool waits that long
at most for their reports, and ``generate`` raises ``RankGroupError`` naming every unfinished
request; the pool is closed from then on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from tqdm import tqdm

from deepinfer.config import Config
from deepinfer.device import resolve_device
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.llm.loop import EngineLoop, Work
from deepinfer.logger import init_logging
from deepinfer.model.families import load_args, load_family
from deepinfer.model.tiny import ensure_tiny_model
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.group import RankGroupError, with_rendezvous_port
from deepinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How long past the collective timeout the pool waits for the surviving ranks' reports.
_REPORT_GRACE_S = 2.0


class RankPool:
    """This host's rank processes of one LLM."""

    def __init__(self, config: Config) -> None:
        parallel = with_rendezvous_port(config.parallel)
        model_dir = config.model.path or str(ensure_tiny_model(config.model.tiny_model_seed))
        self.tokenizer = Tokenizer.from_folder(model_dir, config.model.tokenizer)
        device = resolve_device(config.model.device)
        _check_ranks(config, model_dir, device.type)
        kernel = config.kernel
        if device.type == "cpu" and kernel.num_threads == 0:
            kernel = dataclasses.replace(kernel, num_threads=1)
        self.config = dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, path=model_dir),
            kernel=kernel,
            parallel=parallel,
        )
        self.timeout_s = parallel.collective_timeout_s
        self.failure: str | None = None
        self.info: list[dict[str, Any]] = []  # per local rank, from its "ready" report
        self.stats: list[dict[str, Any]] = []  # per local rank, of the last generate call
        context = multiprocessing.get_context("spawn")
        self.ranks = [parallel.data_parallel_rank + i for i in range(parallel.num_local_ranks)]
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in self.ranks:
            rank_config = dataclasses.replace(
                self.config, parallel=dataclasses.replace(parallel, data_parallel_rank=rank)
            )
            ours, theirs = context.Pipe()
            process = context.Process(
                target=rank_main,
                args=(rank_config, theirs),
                name=f"deepinfer-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)
        self._wait_ready()

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def _wait_ready(self) -> None:
        reports: dict[int, dict[str, Any]] = {}
        errors: dict[int, str] = {}
        # The first failure ends the start: the others would wait for it at the rendezvous.
        while len(reports) < len(self.ranks) and not errors:
            for i, message in self._receive(set(reports), errors, deadline=None):
                if message[0] == "ready":
                    reports[i] = message[1]
                else:
                    errors[i] = message[1]
        if errors:
            self._fail(errors)
            raise RankGroupError(f"the ranks did not start: {self.failure}")
        self.info = [reports[i] for i in range(len(self.ranks))]
        for info in self.info:
            logger.info(
                "rank %d on %s: weights %.3f GiB, routed experts %.3f GiB (%s)",
                info["rank"],
                info["device"],
                info["weight_bytes"] / 2**30,
                info["expert_bytes"] / 2**30,
                info["experts"],
            )

    def generate(self, work: Sequence[Work], use_tqdm: bool) -> list[RequestOutput]:
        if self.failure is not None:
            raise RankGroupError(f"the rank group ended earlier: {self.failure}")
        shares = self._spread(work)
        for conn, share in zip(self.conns, shares, strict=True):
            conn.send(("generate", share))
        outputs: dict[str, RequestOutput] = {}
        open_ids = [{request_id for request_id, _, _ in share} for share in shares]
        done: dict[int, dict[str, Any]] = {}
        errors: dict[int, str] = {}
        deadline: float | None = None
        bar = tqdm(total=len(work), desc="generate", unit="req", disable=not use_tqdm)
        with bar:
            while len(done) + len(errors) < len(self.ranks):
                for i, message in self._receive(set(done) | set(errors), errors, deadline):
                    kind = message[0]
                    if kind == "finished":
                        output: RequestOutput = message[1]
                        outputs[output.request_id] = output
                        open_ids[i].discard(output.request_id)
                        bar.update(1)
                    elif kind == "done":
                        done[i] = message[1]
                    else:
                        errors[i] = message[1]
                if errors and deadline is None:
                    deadline = time.monotonic() + self.timeout_s + _REPORT_GRACE_S
        if errors:
            self._fail(errors)
            failed = {rid: self.failure or "" for ids in open_ids for rid in ids}
            finished = [outputs[rid] for rid, _, _ in work if rid in outputs]
            raise RankGroupError(
                f"the rank group ended with {len(failed)} request(s) unfinished: {self.failure}",
                failed=failed,
                finished=finished,
            )
        self.stats = [done[i] for i in range(len(self.ranks))]
        return [outputs[request_id] for request_id, _, _ in work]

    def _spread(self, work: Sequence[Work]) -> list[list[Work]]:
        """Each request to the local rank with the least work so far (tokens to process)."""
        shares: list[list[Work]] = [[] for _ in self.ranks]
        loads = [0] * len(self.ranks)
        for item in work:
            _, prompt, params = item
            size = len(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
            i = loads.index(min(loads))
            shares[i].append(item)
            loads[i] += size + (params.max_tokens or 0)
        return shares

    def _receive(
        self, finished: set[int], errors: dict[int, str], deadline: float | None
    ) -> list[tuple[int, tuple]]:
        """The next messages from the ranks not in ``finished``; a rank whose process died or
        that missed ``deadline`` gets its entry in ``errors`` (its process is killed)."""
        live = [i for i in range(len(self.ranks)) if i not in finished]
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        waitables = [self.conns[i] for i in live] + [self.processes[i].sentinel for i in live]
        ready = set(wait(waitables, timeout))
        messages = []
        for i in live:
            conn, process = self.conns[i], self.processes[i]
            try:
                while conn in ready and conn.poll():
                    messages.append((i, conn.recv()))
            except (EOFError, OSError):
                ready.add(process.sentinel)
            if process.sentinel in ready:
                process.join(timeout=1.0)
                code = process.exitcode
                errors.setdefault(i, f"rank {self.ranks[i]}'s process died (exit code {code})")
        if not ready and deadline is not None:
            for i in live:
                self.processes[i].kill()
                errors.setdefault(
                    i, f"rank {self.ranks[i]} did not report within {self.timeout_s:.0f} s"
                )
        return messages

    def _fail(self, errors: dict[int, str]) -> None:
        self.failure = "; ".join(errors[i] for i in sorted(errors))
        logger.error("rank group ended: %s", self.failure)
        self.close()

    def close(self) -> None:
        self._finalizer()


def _check_ranks(config: Config, model_dir: str, device_type: str) -> None:
    """What would fail in every rank, raised here at once (ValueError)."""
    parallel = config.parallel
    if parallel.enable_expert_parallel:
        args = load_args(Path(model_dir))
        num_experts = load_family(args.model_type).num_experts(args)
        if num_experts % parallel.data_parallel_size:
            raise ValueError(
                f"{num_experts} routed experts do not split evenly over "
                f"parallel.data_parallel_size = {parallel.data_parallel_size} ranks"
            )
    if device_type in ("cuda", "npu"):
        import torch

        visible = getattr(torch, device_type).device_count()
        if visible < parallel.num_local_ranks:
            raise ValueError(
                f"{parallel.num_local_ranks} ranks on this host need as many {device_type} "
                f"devices; {visible} visible"
            )


def _stop(processes: list, conns: list[Connection]) -> None:
    """Ask every rank to stop; kill what has not stopped within 5 s (a rank in a collective or
    at the rendezvous reads no messages)."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):  # a rank already gone
            conn.send(("stop",))
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


def rank_main(config: Config, conn: Connection) -> None:
    """A rank process: build the engine (joining the group), then run what the parent sends."""
    init_logging(config.log)
    rank = config.parallel.data_parallel_rank
    try:
        engine = LLMEngine(config)
        loop = EngineLoop(engine)
    except BaseException as error:
        conn.send(("failed", f"rank {rank}: {type(error).__name__}: {error}"))
        return
    conn.send(("ready", _rank_info(engine)))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            break
        if message[0] == "stop":
            break
        before = engine.rank_stats()
        try:
            loop.generate(message[1], on_finished=lambda out: conn.send(("finished", out)))
        except BaseException as error:
            logger.error("rank %d: the group ended: %s", rank, error)
            conn.send(("error", f"rank {rank}: {type(error).__name__}: {error}"))
            conn.close()
            os._exit(1)  # the group is broken: tearing it down could wait on the dead peer
        conn.send(("done", engine.stats_since(before, engine.rank_stats())))
    if engine.group is not None:
        engine.group.close()


def _rank_info(engine: LLMEngine) -> dict[str, Any]:
    runner: Any = engine.executor
    experts = runner.experts
    return {
        "rank": engine.group.rank if engine.group else 0,
        "device": str(runner.device),
        "experts": "all" if experts is None else f"{experts.start}..{experts.stop - 1}",
        "weight_bytes": runner.weight_bytes.total,
        "expert_bytes": runner.weight_bytes.routed_experts,
        "num_blocks": runner.num_blocks,
    }

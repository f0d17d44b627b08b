"""Rank processes for tests that drive lock-step engines directly (spawned by test_ranks.py; a
module of its own so that the spawned processes can import the function by name)."""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection

import torch

from deepinfer.config import Config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.ops.moe.expert_parallel import ExpertParallelMoEBackend
from deepinfer.ops.moe.torch_ref import TorchRefMoEBackend
from deepinfer.ops.registry import ParallelContext
from deepinfer.sampling_params import SamplingParams


def drain(engine: LLMEngine) -> tuple[list[int], list[dict[int, float]]]:
    """Step ``engine`` until it has no request left: (its new tokens, their logprobs)."""
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
            logprobs += delta.new_logprobs or []
    return tokens, logprobs


def abort_mid_steps(config: Config, rank: int, plan: dict, conn: Connection) -> None:
    """Rank ``rank``: add ``plan["prompts"][rank]``, step in lock-step, abort ``plan["abort"]``
    (if it is this rank's) after ``plan["abort_after"]`` steps; send back the tokens, the
    lock-step stats and the EP backend's batch-invariance check."""
    torch.set_num_threads(1)
    parallel = dataclasses.replace(config.parallel, data_parallel_rank=rank)
    engine = LLMEngine(dataclasses.replace(config, parallel=parallel))
    params = SamplingParams(temperature=0.0, max_tokens=plan["max_tokens"], ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for request_id, prompt in plan["prompts"][rank].items():
        engine.add_request(request_id, prompt, params)
        tokens[request_id] = []
    steps = 0
    while True:
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
        steps += 1
        if steps == plan["abort_after"] and plan["abort"] in tokens:
            engine.abort_requests([plan["abort"]])
        if not engine.group_unfinished:
            break
    engine.complete_in_flight()
    invariant = _ep_batch_invariant(engine, rank)
    conn.send((tokens, engine.lockstep.stats.as_dict(), invariant))
    engine.group.close()


class _RowByRow(TorchRefMoEBackend):
    """The reference one row at a time: batch-invariant, as the Triton kernels are within a
    tile bucket (a CPU matmul's rows depend on how many rows it has)."""

    def fused_moe(self, x, w1, w2, w3, topk_ids, topk_weights, limit, residual=None):  # type: ignore[override]
        rows = [
            super(_RowByRow, self).fused_moe(
                x[r : r + 1],
                w1,
                w2,
                w3,
                topk_ids[r : r + 1],
                topk_weights[r : r + 1],
                limit,
                None if residual is None else residual[r : r + 1],
            )
            for r in range(x.shape[0])
        ]
        return torch.cat(rows) if rows else torch.zeros_like(x)


def _ep_batch_invariant(engine: LLMEngine, rank: int) -> bool:
    """A token's expert-parallel MoE output alone equals, bit for bit, its output among other
    tokens when the experts' own kernel is batch-invariant: dispatch and combine add no
    dependence on the step's other tokens (both ranks run both calls)."""
    group = engine.group
    context = ParallelContext(group.world_size, rank, group.data)
    moe = ExpertParallelMoEBackend(None, context, _RowByRow())
    gen = torch.Generator().manual_seed(7)  # the same experts on every rank, sliced
    e, d, i, k = 8, 16, 8, 2
    w1, w3 = torch.randn(e, i, d, generator=gen), torch.randn(e, i, d, generator=gen)
    w2 = torch.randn(e, d, i, generator=gen)
    mine = context.shard(e)
    local = [w[mine.start : mine.stop] for w in (w1, w2, w3)]
    x = torch.randn(6, d, generator=gen)
    ids = torch.tensor([[0, 7], [3, 4], [5, 1], [6, 2], [4, 3], [1, 6]])
    weights = torch.rand(6, k, generator=gen)
    token = slice(0, 1) if rank == 0 else slice(0, 0)
    alone = moe.fused_moe(x[token], *local, ids[token], weights[token], 10.0)
    crowd = moe.fused_moe(x, *local, ids, weights, 10.0)
    return bool(torch.equal(alone, crowd[token]))


def decode_handoffs(config: Config, port: int, plan: dict, conn: Connection) -> None:
    """The decode side of a pair: join as rank 1, receive ``plan["ids"]`` concurrently (one
    thread each), import and decode each; then receive ``plan["broken"]`` (the sender cuts it
    short). Sends back {transfer id: tokens | the error}, and the blocks in use at the end."""
    import threading

    from deepinfer.engine.handoff import unpack_state
    from deepinfer.parallel.transfer import PairTransport, TransferError

    torch.set_num_threads(1)
    engine = LLMEngine(config)
    conn.send("ready")
    pair = PairTransport.connect("127.0.0.1", port, 1, timeout_s=plan["timeout_s"])
    received: dict[int, tuple[bytes, list] | str] = {}

    def receive(transfer_id: int) -> None:
        try:
            received[transfer_id] = pair.recv(transfer_id)
        except TransferError as error:
            received[transfer_id] = f"TransferError: {error}"

    threads = [threading.Thread(target=receive, args=(i,)) for i in plan["ids"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    params = SamplingParams(temperature=0.0, max_tokens=plan["max_tokens"], ignore_eos=True)
    results: dict[int, list[int] | str] = {}
    for transfer_id in plan["ids"]:
        got = received[transfer_id]
        if isinstance(got, str):
            results[transfer_id] = got
            continue
        state = unpack_state(*got)
        engine.import_request(state, params)
        results[transfer_id] = list(state.output_token_ids) + drain(engine)[0]
    receive(plan["broken"])
    results[plan["broken"]] = received[plan["broken"]]
    conn.send((results, engine.scheduler.block_manager.num_used_blocks))
    pair.close()


def receive_forever(port: int, conn: Connection) -> None:
    """A receiver that joins and waits on transfer 1 (the test kills it mid-transfer)."""
    from deepinfer.parallel.transfer import PairTransport

    pair = PairTransport.connect("127.0.0.1", port, 1, timeout_s=30.0)
    conn.send("joined")
    pair.recv(1)


def receive_on_gpu(port: int, offer_gpu: bool, num_transfers: int, conn: Connection) -> None:
    """rank 1 of a pair on CUDA device 0 (offering it for CUDA IPC when ``offer_gpu``): sends
    whether the pair shares the GPU, then per transfer (header, the parts' devices, the parts on
    the CPU) or the error's text."""
    from deepinfer.parallel.transfer import PairTransport

    gpu = torch.device("cuda", 0)
    pair = PairTransport.connect(
        "127.0.0.1", port, 1, timeout_s=10.0, ipc_device=gpu if offer_gpu else None
    )
    conn.send(pair.shared_gpu is not None)
    for transfer_id in range(1, num_transfers + 1):
        try:
            header, parts = pair.recv(transfer_id)
        except Exception as error:  # the test reads what failed
            conn.send(f"{type(error).__name__}: {error}")
            continue
        conn.send((header, [str(p.device) for p in parts], [p.cpu() for p in parts]))
    pair.close()


def share_then_die(port: int, conn: Connection) -> None:
    """rank 0 of a pair sharing CUDA device 0: sends one transfer through IPC and is killed
    (SIGKILL, by itself) right after its manifest went out, before the receiver's ack."""
    import os
    import signal

    from deepinfer.parallel.transfer import PairTransport

    gpu = torch.device("cuda", 0)
    pair = PairTransport.connect("127.0.0.1", port, 0, timeout_s=5.0, ipc_device=gpu)
    conn.send(pair.shared_gpu is not None)
    pair.on_shared = lambda: os.kill(os.getpid(), signal.SIGKILL)
    parts = [torch.arange(1 << 20, dtype=torch.float32, device=gpu)]
    pair.send(1, b"doomed", parts, checksum_parts=True)

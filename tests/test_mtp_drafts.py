"""MTP drafts (speculative.method = "mtp", deepseek_v4/mtp.py): the tiny checkpoint's MTP layer
(its own generator: the stack's weights are those of a checkpoint without it), the engine's
tokens with MTP drafts equal to those without (batched, chunked, preempted, prefix hits, async
scheduling on and off), and every draft the engine's MTP layer proposed equal to a from-scratch
pass of the layer over the request's tokens (what the incremental commit, the chained drafts,
rollbacks and snapshots must reproduce), with partly accepted drafts on the way."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from draft_runs import (
    PROMPTS,
    Outputs,
    assert_same_outputs,
    cpu_llm,
    run_with_prefix_hits,
    sampling,
)
from engine_spies import TruthDrafts, graph_shaped
from safetensors.torch import load_file

from deepinfer import LLM
from deepinfer.config import Config
from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten, split_flat
from deepinfer.model.deepseek_v4 import step_plan, tiny
from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.family import FAMILY
from deepinfer.model.deepseek_v4.weights import expected_shapes
from deepinfer.model.families import with_serving_options
from deepinfer.model.tiny import make_tiny_model

MTP = {"method": "mtp", "num_speculative_tokens": 3}
PARAMS = sampling(16)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5)


def test_the_mtp_layer_leaves_the_stack_weights_as_they_were(tmp_path: Path) -> None:
    args = ModelArgs.from_dict(tiny.TINY_CONFIG)
    tiny.write_checkpoint(
        tmp_path,
        tiny.TINY_CONFIG,
        expected_shapes(args),
        lambda name, shape, gen: tiny.init_tensor(name, shape, args, gen),
        seed=5,
        fp8=None,
    )
    without = load_file(tmp_path / "model.safetensors")
    tiny.write_tiny_checkpoint(tmp_path, seed=5)
    written = load_file(tmp_path / "model.safetensors")
    mtp = {k for k in written if k.startswith("mtp.0.")}
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.experts.7.w2.weight"} <= mtp
    assert written.keys() - mtp == without.keys()
    assert all(torch.equal(written[k], without[k]) for k in without)
    # Served: the loader reads them; not served: they are skipped, not unexpected.
    served = with_serving_options(args, yoco_truncation="off", yoco_keep_tokens=0, mtp_layers=1)
    state = FAMILY.load_weights(
        tmp_path, served, device=torch.device("cpu"), dtype=torch.float32, keep_fp8=False
    )
    assert "mtp.0.ffn.experts.w1" in state and state.keys() == expected_shapes(served).keys()
    plain = FAMILY.load_weights(
        tmp_path, args, device=torch.device("cpu"), dtype=torch.float32, keep_fp8=False
    )
    assert not any(k.startswith("mtp.") for k in plain)


def test_mtp_configuration_errors(tiny_dir: Path) -> None:
    assert Config.load(overrides={"speculative": MTP}).cache.max_draft_tokens == 3
    v41 = make_tiny_model(tiny_dir.parent / "v41", model_type="deepseek_v41")
    with pytest.raises(ValueError, match="deepseek_v4 only"):
        LLM(model=v41, device="cpu", speculative_config=MTP)
    args = ModelArgs.from_dict({**tiny.TINY_CONFIG, "num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        dataclasses.replace(args, mtp_served=1)


def _outputs(llm: LLM) -> Outputs:
    return run_with_prefix_hits(llm, PROMPTS, PARAMS, again=2)


@pytest.fixture(scope="module")
def plain(tiny_dir: Path) -> Outputs:
    return _outputs(cpu_llm(tiny_dir, async_scheduling=False))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tokens_with_mtp_drafts_are_those_without(
    tiny_dir: Path, plain: list, async_scheduling: bool
) -> None:
    # num_blocks=8: too few blocks for all four at once, so some are preempted and recomputed.
    llm = cpu_llm(tiny_dir, async_scheduling=async_scheduling, speculative_config=MTP, num_blocks=8)
    assert_same_outputs(_outputs(llm), plain)
    assert llm.engine is not None
    stats = llm.engine.spec_stats()
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] > stats["num_drafts"]
    # Every verify step was timed (a step verifies one run or more).
    assert 0 < sum(stats["verify_time_counts"]) <= stats["num_drafts"]
    assert stats["verify_time_sum"] > 0
    assert llm.engine.num_preemptions > 0


def test_mtp_drafts_with_window_lists_derived_on_the_device(
    tiny_dir: Path, plain: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step's window lists derived on the device (step_plan.WindowPlan: a step of
    WINDOW_ON_DEVICE_MIN_TOKENS tokens or more, here all), the MTP layer's commit and draft
    batches included: the tokens without drafts."""
    from deepinfer.model.deepseek_v4 import step_plan

    monkeypatch.setattr(step_plan, "WINDOW_ON_DEVICE_MIN_TOKENS", 0)
    llm = cpu_llm(tiny_dir, speculative_config=MTP)
    assert_same_outputs(_outputs(llm), plain)


def _mtp_pass(model, kv: KVCache, streams: torch.Tensor, tokens: list[int]):
    """The MTP layer from scratch over positions 0 .. n-1 of an empty slot: (logits at the last
    position, output streams of every position)."""
    n = len(tokens)
    seqs = [SeqSpan(0, n, 0, 0, [])]
    geometry = dataclasses.replace(FAMILY.geometry(model.args, kv), ratios=(), dense_ratios=())
    host = step_plan.step_arrays(seqs, tokens, [n - 1], geometry)
    dev = split_flat(torch.from_numpy(flatten(host)), host)
    batch = ForwardBatch(
        dev["input_ids"], dev["positions"], seqs, dev["logits_indices"],
        metadata=step_plan.metadata_views(dev, geometry),
    )  # fmt: skip
    logits, out = model.mtp_forward(streams, batch, kv)
    return logits[0], out


def _reference_drafts(model, tokens: list[int], drafts: list[int]) -> list[tuple[float, int]]:
    """For each draft position: (the top-2 logit margin, the argmax) of the MTP layer run from
    scratch after ``tokens`` (the chained positions reading the drafts before them)."""
    spec = FAMILY.cache_spec(model.args, block_size=16, ring_margin=16, max_draft=3)
    kv = KVCache(spec, num_blocks=16, num_slots=1, dtype=torch.float32, device=torch.device("cpu"))
    e = len(tokens) - 1  # positions the target computed
    seqs = [SeqSpan(0, e, 0, 0, list(range(16)))]
    geometry = FAMILY.geometry(model.args, kv)
    host = FAMILY.step_arrays(seqs, tokens[:e], [e - 1], geometry)
    batch = FAMILY.batch_views(torch.from_numpy(flatten(host)), host, seqs, geometry)
    model(batch, kv)
    streams, inputs, out = batch.hidden, tokens[1:], []
    for j in range(len(drafts)):
        logits, outputs = _mtp_pass(model, kv, streams, inputs)
        top = logits.topk(2).values
        out.append((float(top[0] - top[1]), int(logits.argmax())))
        streams = torch.cat([streams, outputs[-1:]])
        inputs = [*inputs, drafts[j]]
    return out


@pytest.mark.parametrize("graphed", [False, True])
def test_every_mtp_draft_is_the_layer_run_from_scratch(
    tiny_dir: Path, plain: list, graphed: bool
) -> None:
    """``graphed``: the verify steps shaped as CUDA graphs run them (``graph_shaped``), the
    last layer's streams the MTP layer reads taken from the padded rows."""
    llm = cpu_llm(tiny_dir, async_scheduling=True, speculative_config=MTP, num_blocks=8)
    assert llm.engine is not None
    runner = llm.engine.executor
    steps = graph_shaped(runner, max_tokens=4) if graphed else []
    recorder = TruthDrafts(runner.step_drafts.run, PROMPTS, [t for t, _ in plain[: len(PROMPTS)]])
    runner.step_drafts.run = recorder
    assert_same_outputs(_outputs(llm), plain)
    if graphed:
        assert any(n > 1 and rows == 4 for n, rows in steps), f"no batched verify step: {steps}"
    stats = llm.engine.spec_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert llm.engine.num_preemptions > 0
    checked = 0
    for tokens, drafts in recorder.records:
        reference = _reference_drafts(runner.model, tokens, drafts)
        for (margin, want), got in zip(reference, drafts, strict=True):
            if margin > 1e-3:  # a near-tie may flip with the order of the sums
                assert got == want, (len(tokens), drafts)
                checked += 1
    assert checked > 0.9 * sum(len(d) for _, d in recorder.records) > 100

"""transformers' eager DeepSeek-V4 on the same V4-Flash-shaped layers and weights; ours / theirs.

    bash scripts/gpu_bench.sh benchmarks/v4_flash_hf.py [--layers csa,hca,swa] [--batch 1,32]
        [--context 4096] [--prompt 1024,8192] [--ours DECODE.json PREFILL.json] [--json PATH]
    python benchmarks/v4_flash_hf.py --tiny [--ours ...]      # CPU smoke test, shapes shrunk

Method. As in v4_flash_decode.py, one model per layer type (one layer of it) plus one with no
layers ("outer": embedding, hyper-connection head, norm, LM head), built one after the other:
here ``transformers.DeepseekV4ForCausalLM`` with ``attn_implementation="eager"`` and the routed
experts' ``--experts`` implementation (default "eager": its loop over the experts hit). Its
weights are ours (``random_weights``, same seed, drawn on the same device, renamed to
transformers' names: the same values; on the CPU both models give the same logits).

Decode: transformers prefills ``--context`` tokens of each of the batch's requests itself, in
forwards of ``--chunk-tokens`` tokens (its DynamicCache; chunked prefill gives the logits of one
whole forward), then single-token steps on that cache are timed (CUDA events, warm-up, median;
every step appends a token). Prefill: one request, forwards of ``--chunk-tokens`` tokens on a
fresh cache, the whole prompt timed. Per layer = model − outer for the same batch and context
(prompt). Full depth = 21 CSA + 20 HCA + 2 sliding + outer, extrapolated.

Ours / theirs: our per-layer figures from the JSON files v4_flash_decode.py and
v4_flash_prefill.py write (``--ours``), matched on layer type, batch and context (prompt). Goal
(BENCH.md): ours >= 20x transformers' decode throughput at batch 32. Prints the per-layer table,
the comparison table last, then a RESULTS: block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    LAYER_TYPES,
    OUTER,
    PLANS,
    Setup,
    add_common_args,
    config_dict,
    experts_hit,
    make_setup,
    model_args,
    parse_ints,
    parse_layers,
    release,
)
from v4_flash_report import (
    copy_bandwidth,
    decode_bytes,
    device_name,
    expected_experts_hit,
    full_depth_from,
    gemm_rate,
    header,
    markdown,
    median_time,
    ms,
    prefill_flops,
    ratio,
    results_block,
    table,
    write_json,
)

from deepinfer.model.deepseek_v4.tiny import random_weights
from deepinfer.model.deepseek_v4.weights import map_checkpoint_name

SCRIPT = "v4_flash_hf.py"
GOAL_BATCH, GOAL_SPEEDUP = 32, 20.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch", help="decode batch sizes (default 1,32; --tiny: 1,4)")
    ap.add_argument("--context", type=int, help="decode context (default 4096; --tiny: 64)")
    ap.add_argument("--prompt", help="prefill prompt lengths (default 1024,8192; --tiny: 32,64)")
    ap.add_argument("--chunk-tokens", type=int, help="tokens per prefill forward (default 4096)")
    ap.add_argument("--experts", default="eager", help="experts_implementation: eager | ...")
    ap.add_argument("--ours", nargs="*", default=[], help="JSON files of our two scripts")
    add_common_args(ap, warmup=2, repeats=5, ours=False)
    ns = ap.parse_args()
    setup = make_setup(ns.tiny)
    kinds = parse_layers(ns.layers)
    batches = parse_ints(ns.batch or ("1,4" if ns.tiny else "1,32"))
    context = ns.context or (64 if ns.tiny else 4096)
    prompts = parse_ints(ns.prompt or ("32,64" if ns.tiny else "1024,8192"))
    chunk_tokens = ns.chunk_tokens or (16 if ns.tiny else 4096)

    bandwidth, rate = copy_bandwidth(setup), gemm_rate(setup)
    print(
        f"{device_name(setup)}: copy bandwidth {bandwidth / 1e12:.3f} TB/s, dense GEMM "
        f"{rate / 1e12:.3g} TFLOP/s ({setup.dtype})"
    )
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth, "rows": rows}
    payload["gemm_flops"] = rate
    for kind in [OUTER, *kinds]:
        hf = build_hf(kind, setup, ns.seed, ns.experts)
        args = model_args(kind, 1, setup.tiny)
        for batch_size in batches:
            seconds, counts = time_decode(hf, setup, batch_size, context, chunk_tokens, ns)
            hit = sum(counts) / len(counts) if counts else expected_experts_hit(args, batch_size)
            row = {"kind": "decode", "layer": kind, "batch": batch_size, "context": context}
            rows.append({**row, "model_s": seconds, "experts_hit": hit})
            rows[-1]["bytes"] = decode_bytes(args, kind, batch_size, context, hit, setup.dtype)
            print(f"  {kind:5} decode batch {batch_size:3} ctx {context}: {_shown(seconds)}")
            release()  # the step's cache
        for prompt_len in prompts:
            seconds = time_prefill(hf, setup, prompt_len, chunk_tokens, ns)
            row = {"kind": "prefill", "layer": kind, "prompt": prompt_len, "model_s": seconds}
            rows.append({**row, "flops": prefill_flops(args, kind, 0, prompt_len)})
            print(f"  {kind:5} prefill {prompt_len}: {_shown(seconds)}")
            release()
        derive(rows, bandwidth, rate)
        write_json(ns.json, payload)
        del hf
        release()
    ours = [r for path in ns.ours for r in _read_rows(Path(path))]
    report(rows, ours, kinds, batches, context, prompts, chunk_tokens, setup, ns)


def build_hf(kind: str, setup: Setup, seed: int, experts: str) -> torch.nn.Module:
    """transformers' model with one layer of ``kind`` (none for outer) and our random weights."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    types = [] if kind == OUTER else [LAYER_TYPES[kind]]
    config = DeepseekV4Config(**config_dict(types, setup.tiny))
    with torch.device(setup.device):
        hf = DeepseekV4ForCausalLM._from_config(
            config, dtype=setup.dtype, attn_implementation="eager", experts_implementation=experts
        )
    ours = random_weights(model_args(kind, 1, setup.tiny), seed, setup.device, setup.dtype)
    hf.load_state_dict(hf_weights(hf.state_dict().keys(), ours), strict=True)
    return hf.eval()


def hf_weights(names: list[str], ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors under transformers' names (the loader's mapping, inverted); consumes ``ours``.
    transformers fuses the experts' w1 and w3: gate_up_proj [E, 2I, D] = cat(w1, w3)."""
    out = {}
    for name in names:
        target = map_checkpoint_name(name)
        assert target is not None, f"transformers parameter {name} has no counterpart"
        parts = [ours.pop(n) for n in target.names]
        out[name] = parts[0] if target.kind == "copy" else torch.cat(parts, dim=1)
    assert not ours, f"our parameters with no transformers counterpart: {sorted(ours)[:5]}"
    return out


@torch.inference_mode()
def time_decode(
    hf: torch.nn.Module, setup: Setup, batch_size: int, context: int, chunk_tokens: int, ns
) -> tuple[float | None, list[int]]:
    """(median seconds of one decode step after a ``context``-token prefill, distinct experts
    each router picked in one step)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(ns.seed)
    vocab = hf.config.vocab_size
    prompt = torch.randint(3, vocab, (batch_size, context), generator=gen).to(setup.device)
    step_ids = torch.randint(3, vocab, (batch_size, 1), generator=gen).to(setup.device)
    cache = DynamicCache(config=hf.config)
    width = max(1, chunk_tokens // batch_size)

    def step(cache=cache) -> object:
        return hf(input_ids=step_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    try:
        for start in range(0, context, width):
            chunk = prompt[:, start : start + width]
            hf(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
        seconds = median_time(step, setup, ns.warmup, ns.repeats)
        counts = experts_hit(hf, step)
    except torch.OutOfMemoryError as error:
        print(f"  decode batch {batch_size}: OOM ({str(error).splitlines()[0]})")
        return None, []
    return seconds, counts


@torch.inference_mode()
def time_prefill(
    hf: torch.nn.Module, setup: Setup, prompt_len: int, chunk_tokens: int, ns
) -> float | None:
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(ns.seed)
    prompt = torch.randint(3, hf.config.vocab_size, (1, prompt_len), generator=gen)
    prompt = prompt.to(setup.device)

    def prefill() -> None:
        cache = DynamicCache(config=hf.config)
        for start in range(0, prompt_len, chunk_tokens):
            chunk = prompt[:, start : start + chunk_tokens]
            hf(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)

    try:
        return median_time(prefill, setup, 1, max(1, ns.repeats // 2))
    except torch.OutOfMemoryError as error:
        print(f"  prefill {prompt_len}: OOM ({str(error).splitlines()[0]})")
        return None


def derive(rows: list[dict], bandwidth: float, rate: float) -> None:
    """Per layer = model − outer on the same batch and context (prompt); bounds; efficiency =
    bound / measured (decode: share of the HBM bound; prefill: MFU)."""
    outer = {_key(r): r["model_s"] for r in rows if r["layer"] == OUTER}
    for r in rows:
        r["layer_s"] = r["model_s"]
        if r["layer"] != OUTER:
            base = outer.get(_key(r))
            r["layer_s"] = None if r["model_s"] is None or base is None else r["model_s"] - base
        if r["kind"] == "decode":
            r["bound_s"] = r["bytes"] / bandwidth
        else:
            r["bound_s"] = r["flops"] / rate
        r["efficiency"] = ratio(r["bound_s"], r["layer_s"]) if r["bound_s"] else None


def _key(row: dict) -> tuple:
    return (row["kind"], row.get("batch"), row.get("context"), row.get("prompt"))


def report(rows, ours, kinds, batches, context, prompts, chunk_tokens, setup, ns) -> None:
    def label(r: dict) -> str:
        if r["kind"] == "decode":
            return f"decode b{r['batch']} ctx {r['context']}"
        return f"prefill {r['prompt']}"

    per_layer_headers = ["layer", "figure", "ms", "tok/s", "bound ms", "% of bound"]
    per_layer = [
        [
            r["layer"],
            label(r),
            ms(r["layer_s"]),
            ratio(r.get("batch") or r.get("prompt"), r["layer_s"]),
            ms(r["bound_s"]),
            None if r["efficiency"] is None else 100 * r["efficiency"],
        ]
        for r in rows
    ]
    compare_headers = ["figure", "layer", "ours ms", "transformers ms", "ours tok/s",
                       "transformers tok/s", "ours / transformers"]  # fmt: skip
    compare, notes = [], set()
    figures = [("decode", {"batch": b, "context": context}, b) for b in batches]
    figures += [("prefill", {"prompt": p}, p) for p in prompts]
    goal = None
    for kind, match, tokens in figures:
        mine = [r for r in ours if r["kind"] == kind]
        theirs = [r for r in rows if r["kind"] == kind]
        name = label({"kind": kind, **match})
        for layer in [*kinds, "full depth"]:
            if layer == "full depth":
                a = full_depth_from(mine, kinds, "layer_s", notes, **match) if mine else None
                b = full_depth_from(theirs, kinds, "layer_s", notes, **match)
            else:
                a = _find(mine, layer, match)
                b = _find(theirs, layer, match)
            speedup = ratio(b, a)
            compare.append([name, layer, ms(a), ms(b), ratio(tokens, a), ratio(tokens, b), speedup])
            if kind == "decode" and match["batch"] == GOAL_BATCH and layer == "full depth":
                goal = speedup
    print("\nPer layer, transformers (measured; outer = embedding + hc head + norm + LM head):")
    print(table(per_layer_headers, per_layer))
    print("\nOurs vs transformers (ours from --ours JSON; full depth extrapolated):")
    print(table(compare_headers, compare))
    if goal is not None:
        verdict = "met" if goal >= GOAL_SPEEDUP else "not met"
        print(
            f"decode batch {GOAL_BATCH}, ctx {context}, full depth: ours {goal:.1f}x "
            f"transformers' throughput (goal >= {GOAL_SPEEDUP:.0f}x: {verdict})"
        )
    elif not ours:
        print("no --ours JSON: ratios need v4_flash_decode.py / v4_flash_prefill.py --json")
    notes_text = f" ({'; '.join(sorted(notes))})" if notes else ""
    print()
    print(
        results_block(
            "transformers' eager DeepSeek-V4 vs ours, V4-Flash-shaped layers",
            SCRIPT,
            setup,
            [
                f"Model: one model per layer type ({', '.join(kinds)}; one layer each) in "
                f"V4-Flash shapes{' (--tiny)' if setup.tiny else ''} and one with no layers; "
                "transformers' DeepseekV4ForCausalLM, attention eager, experts "
                f"{ns.experts}, with our random weights (same values, renamed).",
                f"Decode: transformers prefills {context} tokens per request itself (forwards of "
                f"{chunk_tokens} tokens), then steps are timed, median of {ns.repeats}. Prefill: "
                f"one request, forwards of {chunk_tokens} tokens. Per layer = model − outer; "
                f"full depth extrapolated{notes_text}. Ours: {', '.join(ns.ours) or 'not given'} "
                f"(our full depth includes the step plans; {PLANS} rows).",
            ],
            [markdown(per_layer_headers, per_layer), markdown(compare_headers, compare)],
        )
    )


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        print(f"--ours {path}: no such file (its run did not get that far); left out")
        return []
    return json.loads(path.read_text())["rows"]


def _find(rows: list[dict], layer: str, match: dict) -> float | None:
    for r in rows:
        if r["layer"] == layer and all(r.get(k) == v for k, v in match.items()):
            return r.get("layer_s")
    return None


def _shown(seconds: float | None) -> str:
    return "OOM" if seconds is None else f"{seconds * 1e3:.3f} ms"


if __name__ == "__main__":
    main()

"""V4-Flash weight memory: the sizing computation at full depth, checked against an allocation.

    bash scripts/gpu_bench.sh benchmarks/weight_memory.py [--check-layers 16] [--json PATH]
    python benchmarks/weight_memory.py --check-layers 0     # the sizing alone, any machine

The sizing (``deepseek_v4.weights.held_bytes``: bytes per value by how each tensor is held)
for V4-Flash's 43 layers (2 sliding + 21 CSA + 20 HCA, V4_FLASH's shapes) in four forms: all
bf16, FP8 linears (``model.fp8_weights``), FP4 experts packed (``model.fp4_experts``), both.
Then, with CUDA, a model of ``--check-layers`` layers of those shapes (the same mix of types,
scaled) is loaded the way the engine loads one (``engine.weights_loading.load_model``, random
weights, FP8 linears and packed experts): the device memory it holds (``torch.cuda
.memory_allocated`` before and after; its parameters and buffers) against the sizing of those
layers. The brief's figure for the release: ~150 GB with its FP8/FP4 weights kept packed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import FULL_DEPTH_LAYERS, LAYER_TYPES, config_dict, make_setup, write_config
from v4_flash_report import header, markdown, results_block, table, write_json

from deepinfer.config import KernelConfig, ModelConfig
from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.checkpoint import fp8_block
from deepinfer.model.deepseek_v4.weights import held_bytes
from deepinfer.model.families import load_family

SCRIPT = "weight_memory.py"
RELEASE_GB = 150.0


def layer_mix(num_layers: int) -> list[str]:
    """V4-Flash's layer types for ``num_layers`` layers: 2 sliding first (as the release), then
    CSA and HCA alternating."""
    sliding = min(2, num_layers)
    rest = [LAYER_TYPES["csa"] if i % 2 == 0 else LAYER_TYPES["hca"] for i in range(num_layers)]
    return [LAYER_TYPES["swa"]] * sliding + rest[: num_layers - sliding]


def forms(args: ModelArgs) -> dict[str, int]:
    """The weights' bytes held in each form; FP8 linears as the engine keeps them (those under
    model.fp8_min_weights in bf16)."""
    fp8 = {"fp8_block": fp8_block(args), "fp8_min_weights": ModelConfig().fp8_min_weights}
    return {
        "bf16": held_bytes(args, 2),
        "fp8 linears": held_bytes(args, 2, **fp8),
        "fp4 experts": held_bytes(args, 2, fp4_experts=True),
        "fp8 linears + fp4 experts": held_bytes(args, 2, fp4_experts=True, **fp8),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--check-layers", type=int, default=16, help="0: the sizing only")
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    counts = FULL_DEPTH_LAYERS
    full_types = (
        [LAYER_TYPES["swa"]] * counts["swa"]
        + [LAYER_TYPES["csa"]] * counts["csa"]
        + [LAYER_TYPES["hca"]] * counts["hca"]
    )
    full = forms(ModelArgs.from_dict(config_dict(full_types)))
    headers = ["form", "GB (1e9)", "GiB", "vs release ~150 GB"]
    body = [[name, b / 1e9, b / 2**30, b / 1e9 / RELEASE_GB] for name, b in full.items()]
    print(f"V4-Flash, {len(full_types)} layers, sizing from the shapes:")
    print(table(headers, body))
    payload = {"script": SCRIPT, "full_depth": full}
    tables = [markdown(headers, body)]
    notes = [
        f"Sizing: ``held_bytes`` over V4-Flash's {len(full_types)} layers (2 sliding, 21 CSA, "
        "20 HCA) + embedding and head; bf16 values, fp32 norms / hc / sinks, int64 routing "
        "tables; FP8 linears 1 byte + fp32 scales per 128 x 128; packed experts 17/32 byte."
    ]
    setup = None
    if ns.check_layers > 0:
        setup = make_setup(tiny=False)  # exits without CUDA
        payload.update(header(setup))
        check = check_allocation(ns.check_layers, setup.device)
        payload["check"] = check
        print(
            f"\n{ns.check_layers} layers loaded: {check['allocated'] / 1e9:.3f} GB allocated, "
            f"{check['parameters'] / 1e9:.3f} GB parameters + buffers, sizing "
            f"{check['sizing'] / 1e9:.3f} GB"
        )
        check_headers = ["layers", "sizing GB", "parameters + buffers GB", "allocated GB",
                         "allocated / sizing"]  # fmt: skip
        check_body = [[ns.check_layers, check["sizing"] / 1e9, check["parameters"] / 1e9,
                       check["allocated"] / 1e9, check["allocated"] / check["sizing"]]]  # fmt: skip
        tables.append(markdown(check_headers, check_body))
        notes.append(
            f"Check: {ns.check_layers} layers of the same shapes ({check['types']}), loaded by "
            "``load_model`` with random weights, FP8 linears and packed experts on "
            f"{torch.cuda.get_device_name(setup.device)}; allocated = memory_allocated after "
            "- before (the model's parameters and buffers: RoPE tables, hash tables)."
        )
    write_json(ns.json, payload)
    if setup is not None:
        print()
        print(results_block("V4-Flash weight memory, sizing and allocation", SCRIPT, setup,
                            notes, tables))  # fmt: skip


def check_allocation(num_layers: int, device: torch.device) -> dict:
    from deepinfer.engine.weights_loading import load_model
    from deepinfer.ops import select_kernels

    types = layer_mix(num_layers)
    args = ModelArgs.from_dict(config_dict(types))
    family = load_family("deepseek_v4")
    kernels = select_kernels(KernelConfig(), device)
    config = ModelConfig(random_weights=True, fp8_weights=True, fp4_experts=True)
    with tempfile.TemporaryDirectory() as folder:
        write_config(folder, types)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        loaded = load_model(config, family, Path(folder), args, kernels, device, torch.bfloat16)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated(device) - before
    sizing = held_bytes(
        args,
        2,
        fp8_block=fp8_block(args),
        fp4_experts=True,
        fp8_min_weights=config.fp8_min_weights,
    )
    result = {
        "layers": num_layers,
        "types": ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types)),
        "sizing": sizing,
        "parameters": loaded.weight_bytes.total,
        "allocated": allocated,
    }
    del loaded
    return result


if __name__ == "__main__":
    main()

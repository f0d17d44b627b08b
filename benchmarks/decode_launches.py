"""How many kernels a decode step launches, per layer type, and where each non-Triton one comes
from: counted on the CPU, no GPU needed.

    python benchmarks/decode_launches.py [--layers csa,hca,swa] [--batch 1] [--context 64]
        [--experts bf16|fp4|fp4-fp8] [--kv auto|fp8] [--json PATH] [--check]

Method. v4_flash.py's --tiny models (one per layer type, plus the no-layer "outer" model), in
bf16 on the CPU with the Triton backends run by Triton's interpreter (TRITON_INTERPRET=1, set
here before triton is imported; ``ops/triton_interpret.py``), sampling on torch_ref. One decode
step of ``--batch`` requests at ``--context`` tokens, with the plans a decode graph replays
(``v4_flash.graph_plans``), runs once to build its state and once counted:

- Triton launches: every kernel the interpreter runs (``InterpretedFunction.run``), by name;
- other launches: every aten op the step dispatches outside a Triton kernel that writes memory
  (an output whose storage is not an input's, or an in-place op), by op and the model's source
  line that called it. Views, ``empty`` and dtype casts to the same dtype launch nothing and
  are not counted. A GEMM counts one (cuBLAS may add a split-K reduction).

A launch belongs to the layer when it happens inside the layer module's forward (hooks), else to
the step: the embedding, the hyper-connection head, RoPE tables and the plan derivations, once a
step (reported from the no-layer model, whose cache has every layer type). A layer type's model
holds three layers of it and the middle one is counted: a layer inside a deep stack, whose exit
computes the next layer's hyper-connection entry (``hc_post_pre``), and whose own entry the
layer before computed. The shapes are tiny
but the launches are those of V4-Flash's: the same code path at any size, except that which linears
stay FP8 follows ``model.fp8_min_weights`` on the tiny shapes (--experts fp4-fp8).

--check: then each layer type's model in fp32, two such steps on the Triton backends and on
torch_ref's (the same weights and cache), and its logits and every cache part (outside the
scratch slot and block, where discarded rows land in no set order) compared: the fused launches
write what the reference's ops write. It prints each model's largest relative error (||ours -
ref|| / ||ref|| of a tensor) and exits 1 above CHECK_TOL. At a context of 79 the step closes a
window of every ratio (tiny: 4 and 16). (fp32: bf16's roundings would hide a wrong row
behind a bound ~1e4 times looser.)
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on numpy

import argparse
import collections
import dataclasses
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    OUTER,
    WEIGHTS,
    build_model,
    decode_inputs,
    each_layer_model,
    graph_plans,
    kernel_config,
    make_setup,
    model_args,
    parse_layers,
    weight_flags,
)
from v4_flash_report import table, write_json

from deepinfer.ops import attention, linear, moe, norm, registry, select_kernels
from deepinfer.ops.triton_interpret import patch_interpreter

ROOT = Path(__file__).resolve().parents[1]
# Ops that return a view or allocate without writing: no kernel.
NO_KERNEL = {
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.view",
    "aten._unsafe_view", "aten.alias", "aten.detach", "aten.lift_fresh",
}  # fmt: skip


# --check: fp32 kernels against torch_ref's, ~1e-7 apart (summation order, exp and rsqrt
# approximations); a row written to the wrong place or not at all is O(1) of its tensor.
CHECK_TOL = 1e-5

# Where the model is: "layer" inside a layer module's forward, else "step".
SCOPE = ["step"]


class Launches(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (module docstring), by scope, op and source
    line."""

    def __init__(self) -> None:
        super().__init__()
        self.torch: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        stack = traceback.extract_stack()
        if name in NO_KERNEL or any("/triton/" in frame.filename for frame in stack):
            return out
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs or {}))
                  if isinstance(a, torch.Tensor)}  # fmt: skip
        fresh = any(o.untyped_storage().data_ptr() not in inputs
                    for o in tree_leaves(out) if isinstance(o, torch.Tensor))  # fmt: skip
        if fresh or name.endswith("_"):
            ours = [f for f in stack if _ours(f.filename)]
            where = " < ".join(
                f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in ours[-2:][::-1]
            )
            self.torch[(SCOPE[0], name.removeprefix("aten."), where)] += 1
        return out


def _ours(filename: str) -> bool:
    """A frame of the project's code (not the benchmarks', not an installed package's)."""
    path = Path(filename).resolve()
    return path.is_relative_to(ROOT) and not {".venv", "benchmarks"} & set(path.parts)


def count_triton() -> collections.Counter[tuple[str, str]]:
    """Patch the interpreter so that every kernel launch is counted, by scope and kernel."""
    from triton.runtime import interpreter

    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counts[(SCOPE[0], self.fn.__name__)] += 1
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted
    return counts


def interpreted_triton() -> None:
    """The Triton backends on the CPU: the registries' availability check wants CUDA."""
    for family in (attention, linear, moe, norm):
        for name, entry in list(family.BACKENDS._entries.items()):
            if entry.is_available is registry.triton_available:
                family.BACKENDS._entries[name] = dataclasses.replace(
                    entry, is_available=lambda device: (True, "Triton's interpreter")
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--layers", default="csa,hca,swa")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--experts", default="fp4", choices=WEIGHTS[:3])
    ap.add_argument("--kv", default="auto", help="cache.kv_dtype: auto (bf16) or fp8 (packed)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--check", action="store_true", help="compare with torch_ref (docstring)")
    ns = ap.parse_args()
    torch.set_num_threads(2)
    patch_interpreter()
    interpreted_triton()
    triton_counts = count_triton()
    setup = dataclasses.replace(make_setup(tiny=True), dtype=torch.bfloat16)
    results: dict[str, dict] = {}

    def measure(kind: str, args, model) -> None:
        if kind != OUTER:  # the middle of three layers: a layer of a deep stack
            middle = model.layers[1]
            middle.register_forward_pre_hook(lambda *_: SCOPE.__setitem__(0, "layer"))
            middle.register_forward_hook(lambda *_: SCOPE.__setitem__(0, "step"))
        batch, cache = decode_inputs(args, setup, ns.batch, ns.context, 0, kv_dtype=ns.kv)
        graph_plans(batch, cache)
        with torch.no_grad():
            model(batch, cache)  # state built (lazy buffers, compiled nothing: interpreted)
            triton_counts.clear()
            with Launches() as spy:
                model(batch, cache)
        scope = "step" if kind == OUTER else "layer"
        results[kind] = {
            "triton": {k: n for (s, k), n in triton_counts.items() if s == scope},
            "torch": {key[1:]: n for key, n in spy.torch.items() if key[0] == scope},
        }

    backend = "attention=triton,linear=triton,moe=triton,norm=triton"
    kinds = parse_layers(ns.layers)
    each_layer_model(kinds, 3, backend, setup, 0, measure, **weight_flags(ns.experts))
    errors = {kind: check(kind, backend, ns) for kind in kinds} if ns.check else {}

    rows = []
    for kind in [OUTER, *kinds]:
        triton, other = (sum(results[kind][part].values()) for part in ("triton", "torch"))
        rows.append(["step (outer)" if kind == OUTER else kind, triton, other, triton + other])
    print(f"decode step, batch {ns.batch}, context {ns.context}, experts {ns.experts}, kv "
          f"{ns.kv}: launches a layer, and the step's own (outside the layers)")  # fmt: skip
    print(table(["layer", "Triton", "other", "all"], rows))
    for kind in [OUTER, *kinds]:
        print(f"\n{kind}: " + ", ".join(
            f"{k} x{n}" for k, n in sorted(results[kind]["triton"].items())))  # fmt: skip
        for (op, where), n in sorted(results[kind]["torch"].items(), key=lambda i: i[0][1]):
            print(f"  {n} x {op:16} {where}")
    for kind, (err, where) in errors.items():
        print(f"check {kind}: largest relative error against torch_ref {err:.2e} ({where})")
    write_json(ns.json, {"batch": ns.batch, "context": ns.context, "experts": ns.experts,
                         "rows": rows, "counts": {k: {"triton": v["triton"],
                         "torch": {f"{op} @ {w}": n for (op, w), n in v["torch"].items()}}
                         for k, v in results.items()},
                         "check": {k: e for k, (e, _) in errors.items()}})  # fmt: skip
    if any(err > CHECK_TOL for err, _ in errors.values()):
        raise SystemExit(f"check: an error above {CHECK_TOL}")


def check(kind: str, backend: str, ns: argparse.Namespace) -> tuple[float, str]:
    """--check for one layer type: the largest relative error, and where, of two decode steps
    on ``backend`` against torch_ref's, in fp32."""
    setup = make_setup(tiny=True)
    assert setup.dtype == torch.float32, "--check runs on the CPU"
    args = model_args(kind, 3, True)
    runs = []
    for kernels in (backend, "torch_ref"):
        model = build_model(
            args, select_kernels(kernel_config(kernels), setup.device), setup, 0,
            **weight_flags(ns.experts),
        )  # fmt: skip
        batch, cache = decode_inputs(args, setup, ns.batch, ns.context, 0, kv_dtype=ns.kv)
        graph_plans(batch, cache)
        with torch.no_grad():
            model(batch, cache)
            runs.append((model(batch, cache), cache))
    (logits, cache), (ref_logits, ref_cache) = runs
    worst = (rel_err(logits, ref_logits), "logits")
    for key, ref in ref_cache.tensors.items():
        if ref.is_floating_point() and ref.numel():  # the scratch slot / block: the last
            worst = max(worst, (rel_err(cache.tensors[key][:-1], ref[:-1]), str(key)))
    return worst


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


if __name__ == "__main__":
    main()

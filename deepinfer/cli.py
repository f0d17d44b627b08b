"""`deepinfer <subcommand>`: the command-line entry point.

Subcommands add themselves to ``_SUBCOMMANDS``; each has a parser builder and a runner.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from deepinfer.config import SECTIONS, Config, toml_value
from deepinfer.flags import ENGINE_USES, add_config_flags, overrides
from deepinfer.logger import init_logging

_DEFAULT_CONFIG = Path("config.toml")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, ENGINE_USES)


def load_config(ns: argparse.Namespace) -> Config:
    """``--config`` (or ./config.toml), the environment, then the flags that were given."""
    path = getattr(ns, "config", None)
    if path is None and _DEFAULT_CONFIG.is_file():
        path = _DEFAULT_CONFIG
    return Config.load(path, overrides=overrides(ns))


# ---- generate ----------------------------------------------------------------------------


def _generate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("message", help="the user message (or, with --raw, the exact prompt text)")
    p.add_argument("--raw", action="store_true", help="send the text as is (no chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    add_engine_args(p)


def _generate(ns: argparse.Namespace, config: Config) -> int:
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(config=config)
    if ns.raw:
        prompt: str | list[int] = ns.message
    else:
        prompt = encode_chat(llm.get_tokenizer().path, ns.message)
    params = SamplingParams(
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        max_tokens=ns.max_tokens,
    )
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = output.outputs[0]
    print(completion.text)
    print(
        f"[{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
        f"finish_reason={completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def encode_chat(tokenizer_json: Path, message: str) -> list[int]:
    """A single user turn in DeepSeek's V4 encoding (deepseek-recipe), thinking off."""
    import deepseek_recipe as recipe

    encoding = recipe.DeepseekV4Encoding().with_tokenizer(
        recipe.Tokenizer.from_file(str(tokenizer_json))
    )
    conversation = recipe.Conversation([recipe.UserMessage(message)], thinking_mode=False)
    return encoding.encode(conversation)


# ---- make-tiny-model ---------------------------------------------------------------------


def _tiny_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output folder (created; must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model-type",
        default="deepseek_v4",
        choices=("deepseek_v4", "deepseek_v41"),
        help="the model family (default deepseek_v4)",
    )
    p.add_argument(
        "--quantized",
        action="store_true",
        help="store the weights as the release does: FP8 linears with ue8m0 block scales "
        "(V4-Flash 128x128, V4.1-Flash 32x32), routed experts packed FP4 (e2m1, ue8m0 per 32)",
    )
    add_config_flags(p, ("log",))


def _make_tiny(ns: argparse.Namespace, config: Config) -> int:
    from deepinfer.model.tiny import make_tiny_model

    path = make_tiny_model(
        Path(ns.dir), seed=ns.seed, model_type=ns.model_type, quantized=ns.quantized
    )
    print(path)
    return 0


# ---- config ------------------------------------------------------------------------------


def _config_parser(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, tuple(SECTIONS))


_SECRETS = {"api_keys", "node_token", "metrics_key"}


def _show_config(ns: argparse.Namespace, config: Config) -> int:
    for section in dataclasses.fields(config):
        print(f"[{section.name}]")
        for key, value in dataclasses.asdict(getattr(config, section.name)).items():
            if value is None:
                print(f"# {key} = (unset)")
            elif key in _SECRETS and value:
                print(f"# {key} = (set, not shown)")
            else:
                print(f"{key} = {toml_value(value)}")
        print()
    return 0


def _node_parser(p: argparse.ArgumentParser) -> None:
    from deepinfer.server.node import add_node_arguments

    add_node_arguments(p)


def _node(ns: argparse.Namespace, config: Config) -> int:
    from deepinfer.server.node import run_node

    return run_node(ns, config)


def _serve_parser(p: argparse.ArgumentParser) -> None:
    from deepinfer.server.serve import add_serve_arguments

    add_serve_arguments(p)


def _serve(ns: argparse.Namespace, config: Config) -> int:
    from deepinfer.server.serve import run_serve

    return run_serve(ns, config)


def _coordinator_parser(p: argparse.ArgumentParser) -> None:
    from deepinfer.server.coordinator import add_coordinator_arguments

    add_coordinator_arguments(p)


def _coordinator(ns: argparse.Namespace, config: Config) -> int:
    from deepinfer.server.coordinator import run_coordinator

    return run_coordinator(ns, config)


def _bench_parser(p: argparse.ArgumentParser) -> None:
    from deepinfer.bench.serve import add_bench_serve_arguments

    sub = p.add_subparsers(dest="bench_command", required=True)
    bench_serve = sub.add_parser(
        "serve", help="benchmark an OpenAI-compatible server (vLLM's flags)"
    )
    add_bench_serve_arguments(bench_serve)
    add_config_flags(bench_serve, ("log",))


def _bench(ns: argparse.Namespace, config: Config) -> int:
    from deepinfer.bench.serve import main as bench_serve

    return bench_serve(ns)


def _sim_parser(p: argparse.ArgumentParser) -> None:
    from deepinfer.bench.sim import add_sim_arguments

    add_sim_arguments(p)
    add_config_flags(p, ("log",))


def _sim(ns: argparse.Namespace, config: Config) -> int:
    from deepinfer.bench.sim import main as sim

    return sim(ns)


_Runner = Callable[[argparse.Namespace, Config], int]
_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], _Runner]] = {
    "serve": ("the API server with one in-process node (the default)", _serve_parser, _serve),
    "generate": ("generate a reply to one message", _generate_parser, _generate),
    "coordinator": ("run the public API in front of nodes", _coordinator_parser, _coordinator),
    "node": ("run one node: token ids in, token deltas out (internal API)", _node_parser, _node),
    "bench": ("benchmarks: `bench serve` measures a running server", _bench_parser, _bench),
    "sim": ("simulate a fleet's routing policies on a request trace", _sim_parser, _sim),
    "make-tiny-model": ("write a small random checkpoint", _tiny_parser, _make_tiny),
    "config": ("print the resolved configuration", _config_parser, _show_config),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__.splitlines()[0])
    add_config_flags(parser, ("log",), config_file=False)  # also before the subcommand
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, build, _) in _SUBCOMMANDS.items():
        build(sub.add_parser(name, help=help_text, allow_abbrev=False))
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        config = load_config(ns)
        init_logging(config.log)
        return _SUBCOMMANDS[ns.command][2](ns, config)
    except (ValueError, FileNotFoundError) as e:
        print(f"deepinfer {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

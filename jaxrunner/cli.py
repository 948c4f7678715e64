"""The ``jaxrunner`` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jaxrunner", description="vLLM's model runner in JAX.")
    commands = parser.add_subparsers(dest="command")
    demo = commands.add_parser("demo", help="run the built-in tiny model on a batch of prompts (default)")
    demo.add_argument("--num-prompts", type=int, default=4)
    demo.add_argument("--prompt-len", type=int, default=24)
    demo.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    from jaxrunner.demo import run_demo

    run_demo(
        num_prompts=getattr(args, "num_prompts", 4),
        prompt_len=getattr(args, "prompt_len", 24),
        max_tokens=getattr(args, "max_tokens", 32),
    )

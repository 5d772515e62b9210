"""`perseus-ext patch-path`: where the shipped Megatron-LM patches are, for `git apply`.

    git -C Megatron-LM apply "$(perseus-ext patch-path)/pretrain_gpt.core_v0.16.patch"
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "patch-path",
        help="print the directory of the shipped Megatron-LM patches",
        description="Print the directory holding the Megatron-LM patches that add --perseus to "
        "pretrain_gpt.py (one per megatron-core release line; see the README there).",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from perseus_ext.data import patches_dir

    print(patches_dir() / "megatron-lm")
    return 0

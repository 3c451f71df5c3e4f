"""``aitlrt sft``: placeholder, being written."""

from __future__ import annotations

import argparse


def add_parser(verbs: argparse._SubParsersAction) -> None:
    verbs.add_parser("sft", help="(being written)")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("aitlrt sft: not written yet")

"""``aitlrt trajectories``: placeholder, being written."""

from __future__ import annotations

import argparse


def add_parser(verbs: argparse._SubParsersAction) -> None:
    verbs.add_parser("trajectories", help="(being written)")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("aitlrt trajectories: not written yet")

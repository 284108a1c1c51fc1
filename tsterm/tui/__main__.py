"""`python -m tsterm.tui [--profile NAME|PATH] [--auto] [--workspace DIR]`: the TUI without the CLI (`tsterm
[--profile ...]` is the same)."""
from __future__ import annotations

import argparse
import sys

from tsterm.tui import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tsterm.tui")
    parser.add_argument("--profile", default="default", help="profile name or YAML path")
    parser.add_argument("--auto", action="store_true", help="agent sessions run tools without asking")
    parser.add_argument("--workspace", default=None, help="agent sessions' directory (default: the profile's)")
    args = parser.parse_args()
    sys.exit(main(args.profile, args.auto, args.workspace))

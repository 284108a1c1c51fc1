"""`python -m tsterm.tui [--profile NAME|PATH]`: the TUI without the CLI (`tsterm [--profile ...]` is the same)."""
from __future__ import annotations

import argparse
import sys

from tsterm.tui import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tsterm.tui")
    parser.add_argument("--profile", default="default", help="profile name or YAML path")
    sys.exit(main(parser.parse_args().profile))

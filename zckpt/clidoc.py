"""Render docs/cli.md from the argparse parser, so the CLI reference cannot drift.

``python -m zckpt.clidoc > docs/cli.md`` rewrites it; ``tests/test_docs.py`` fails when a
subcommand or an option of the parser is missing from the page (or the page names one the
parser does not have).
"""

from __future__ import annotations

import argparse
import os
import sys

from zckpt.cli import _parser

INTRO = """\
# zckpt command line reference

Generated from the argument parser by `python -m zckpt.clidoc > docs/cli.md`; the tests
check that every subcommand and option below exists and that none is missing.

Every zckpt error is printed as one line naming the file and parameter involved, with exit
code 1; usage errors exit with 2. `--json` prints the command's report as JSON on stdout.
A walk-through of the commands on MindSpore's own example is in
[tutorial.md](tutorial.md).
"""


def subcommands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """``{name: subparser}`` in the order the parser declares them."""
    p = parser or _parser()
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(sub: argparse.ArgumentParser) -> set[str]:
    """Every option string (``--store``, ``-h``...) and positional name of a subcommand."""
    out: set[str] = set()
    for a in sub._actions:
        out.update(a.option_strings or [a.dest])
    return out


def render() -> str:
    """The whole page: intro, then each subcommand's one-line summary and full ``--help``."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal width: fix it
    try:
        parser = _parser()
        helps = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {c.dest: c.help or "" for c in action._choices_actions}
        parts = [INTRO]
        for name, sub in subcommands(parser).items():
            parts.append(f"## zckpt {name}\n\n{helps.get(name, '')}\n\n```text\n{sub.format_help().rstrip()}\n```\n")
        return "\n".join(parts)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


if __name__ == "__main__":
    sys.stdout.write(render())

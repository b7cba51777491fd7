"""Render docs/cli.md from the argparse parser, so the CLI reference cannot drift.

``python -m zckpt.cli.doc > docs/cli.md`` rewrites it; ``tests/test_docs.py`` fails when a
subcommand or an option of the parser is missing from the page (or the page names one the
parser does not have).
"""

from __future__ import annotations

import argparse
import os
import sys

from zckpt.cli.args import SIZE_RULE, older_spellings
from zckpt.cli.parser import build_parser

INTRO = f"""\
# zckpt command line reference

Generated from the argument parser by `python -m zckpt.cli.doc > docs/cli.md`; the tests
check that every subcommand and option below exists and that none is missing.
`zckpt` alone prints the list of commands; a misspelt command or option gets a suggestion.

**Exit codes.** 0: done. 1: zckpt refused the input or the output, a path that does not
exist included; the error is one line naming the file and parameter involved (with `--json`
also a JSON document on stdout, see [faq.md](faq.md#exit-codes)). 2: the command line cannot
be read (an unknown option, a missing argument, a value of the wrong form, options that do
not go together), found before any file is read. 130: interrupted; 141: the output pipe
closed.

**Sizes.** Every size option (`--max-mem`, `--block-size`, `--chunk-size`, `--pack-size`,
`--max-file-size`) reads its value one way; {SIZE_RULE}.

**Names.** Options have one name across commands: `--src-strategy` and `--dst-strategy` for
the strategies, `--out` for what a command writes, `--rank K` for a destination rank,
`--no-verify-checksums` to skip a command's checksum checks. Older spellings still work;
each command lists its own below its help, and no page teaches them.

A walk-through of the commands on MindSpore's own example is in [tutorial.md](tutorial.md).
"""


def subcommands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """``{name: subparser}`` in the order the parser declares them."""
    p = parser or build_parser()
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(sub: argparse.ArgumentParser) -> set[str]:
    """Every option string (``--store``, ``-h``...) and positional name a subcommand's help
    shows (older spellings are hidden from it: :func:`zckpt.cli.args.older_spellings`)."""
    out: set[str] = set()
    for a in sub._actions:
        if a.help != argparse.SUPPRESS:
            out.update(a.option_strings or [a.dest])
    return out


def _older(sub: argparse.ArgumentParser) -> str:
    old = older_spellings(sub)
    if not old:
        return ""
    listed = ", ".join(f"`{o}` (now `{new}`)" for o, new in old.items())
    return f"Older spellings, still accepted: {listed}.\n"


def render() -> str:
    """The whole page: intro, then each subcommand's one-line summary and full ``--help``."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal width: fix it
    try:
        parser = build_parser()
        helps = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {c.dest: c.help or "" for c in action._choices_actions}
        parts = [INTRO]
        for name, sub in subcommands(parser).items():
            parts.append(f"## zckpt {name}\n\n{helps.get(name, '')}\n\n```text\n{sub.format_help().rstrip()}\n```\n"
                         f"{_older(sub)}")
        return "\n".join(parts)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


if __name__ == "__main__":
    sys.stdout.write(render())

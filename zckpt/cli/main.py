"""Command line: ``zckpt ingest | export | transform | plan | info | merge-strategies | load | consolidate``.

Every refusal (a path that is not there, a file that is wrong, an output zckpt will not
replace) is printed as one line naming the file and parameter, with exit code 1 (with
``--json`` also as a JSON object on stdout); a command line that cannot be read exits with 2
(argparse's errors and :class:`~zckpt.core.errors.CommandLineError`, found before any file is
read); a closed stdout (``| head``) ends quietly with 141, Ctrl-C with 130 after the writers
removed their temporary files. Bare ``zckpt`` prints the help.

This module is the program's entry (:func:`run`, :func:`main`) and its errors turned into
exit codes; the parser is :mod:`zckpt.cli.parser`, the commands :mod:`zckpt.cli.commands`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zckpt.cli.args import Parser, check_values
from zckpt.cli.commands import COMMANDS
from zckpt.cli.parser import build_parser
from zckpt.core.errors import CommandLineError, ZckptError

ONE_THREAD = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""The BLAS libraries behind numpy (pip's OpenBLAS, conda's MKL) start a thread per core when
numpy is imported, 0.1 s of every command's start on 2 cores; zckpt does no linear algebra.
Set by :func:`run`, the program's entry, before numpy's import (the commands import it
only where they need it); never by ``import zckpt``, which leaves its caller's
process as it was."""


EXIT_ERROR, EXIT_USAGE, EXIT_PIPE, EXIT_INTERRUPT = 1, 2, 141, 130
"""Exit codes: a refusal; bad arguments (argparse's code); stdout closed by the reader
(``zckpt info ... | head``: 128 + SIGPIPE, quietly); interrupted (128 + SIGINT)."""


def error_doc(err: BaseException, command: str) -> dict[str, Any]:
    """An error as the JSON that ``--json`` prints, so scripts read failures as they read reports."""
    doc: dict[str, Any] = {"command": command, "type": type(err).__name__}
    if isinstance(err, ZckptError):
        doc.update(message=err.message, file=err.path, param=err.param)
    else:
        doc["message"] = str(err)
    return {"error": doc}


def _fail(err: BaseException, args: argparse.Namespace, code: int) -> int:
    text = str(err) if isinstance(err, ZckptError) else f"{type(err).__name__}: {err}"
    print(f"zckpt {args.command}: error: {text}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps(error_doc(err, args.command), indent=1))
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if args.command is None:  # bare ``zckpt``: what it can do, as ``--help`` shows it
        parser.print_help()
        return 0
    if extras:
        _subcommand(parser, args.command).unrecognized(extras)
    try:
        check_values(args)
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
        return code
    except CommandLineError as err:
        return _fail(err, args, EXIT_USAGE)
    except ZckptError as err:
        return _fail(err, args, EXIT_ERROR)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except KeyboardInterrupt:
        remove_own_temporaries(args)
        print(f"zckpt {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPT
    except (OSError, TypeError, ValueError) as err:
        return _fail(err, args, EXIT_ERROR)


def _subcommand(parser: argparse.ArgumentParser, name: str) -> Parser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices[name]
            assert isinstance(sub, Parser)
            return sub
    raise AssertionError(name)


def remove_own_temporaries(args: argparse.Namespace) -> None:
    """Remove the temporary files this process left in its output directory or store.

    Writers remove their temporary file when they fail, but Ctrl-C may land between the
    file's creation and the ``with`` that would remove it. Temporary names carry the pid
    (:func:`zckpt.io.safe_paths.temp_name`), so this process's own are told apart from a
    concurrent run's."""
    mine = f"*.{os.getpid()}.*.tmp-zckpt"
    for where in (getattr(args, "out", None), getattr(args, "store", None)):
        if not where or "://" in str(where) or not Path(where).is_dir():
            continue
        for tmp in Path(where).rglob(mine):
            try:
                if tmp.is_file() and not tmp.is_symlink():
                    tmp.unlink()
            except OSError:
                pass


def _silence_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null so that Python's final flush
    does not raise a second BrokenPipeError at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> int:
    """The ``zckpt`` program (console script and ``python -m zckpt.cli``): :func:`main` in a
    process whose BLAS stays on one thread (:data:`ONE_THREAD`; a user's own setting wins)."""
    for name in ONE_THREAD:
        os.environ.setdefault(name, "1")
    return main()


if __name__ == "__main__":
    sys.exit(run())

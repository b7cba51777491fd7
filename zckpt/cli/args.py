"""The command line's shared vocabulary: one reading of sizes for every size option, older
option spellings kept working but out of the help, and "did you mean" for a misspelt
command or option (Python 3.11's argparse has no ``suggest_on_error``).

Sizes: a number with a unit, ``512KiB``, ``64MiB``, ``2GiB``, ``1TiB`` (powers of 1024; ``K``,
``M``, ``G``, ``T`` alone mean the same), ``64MB`` (powers of 1000) or ``4096B``; a plain
number is MiB, for every size option. Options that can be off take ``0``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

import zckpt
from zckpt.core.errors import CommandLineError, UsageError

MiB = 1024 * 1024

SIZE_RULE = ("a SIZE is a number with a unit: 512KiB, 64MiB, 2GiB (powers of 1024) or 64MB, 2GB (powers of 1000) "
             "or 4096B; a plain number is MiB")
"""The rule once, for the help texts and the generated reference."""

_UNITS = {"": MiB, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": MiB, "mib": MiB, "mb": 1000**2,
          "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*")


def parse_size(text: str, *, zero: bool = False) -> int:
    """``'512MiB'`` / ``'2GiB'`` / ``'1.5G'`` / ``'64MB'`` / ``'4096B'`` -> bytes; a plain number
    is MiB (``'64'`` -> 64 MiB). ``0`` is accepted only where ``zero`` says the option can be off."""
    found = _SIZE.fullmatch(text.lower())
    if found is None or found.group(2) not in _UNITS:
        raise UsageError(f"cannot read size {text!r} ({SIZE_RULE})")
    value = float(found.group(1))
    n = int(value * _UNITS[found.group(2)])
    if n == 0 and not (zero and value == 0):
        raise UsageError(f"size {text!r} must be {'0 or ' if zero else ''}at least 1 byte")
    return n


def size_type(minimum: int = 1, zero: bool = False) -> Callable[[str], int]:
    """An argparse ``type=`` reading a SIZE into bytes: a bad value is a usage error (exit 2)."""

    def parse(text: str) -> int:
        try:
            n = parse_size(text, zero=zero)
        except UsageError as err:
            raise argparse.ArgumentTypeError(err.message) from None
        if n and n < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below the least allowed, {minimum // MiB} MiB")
        return n

    parse.__name__ = "size"  # argparse names the type in "invalid size value: ..."
    return parse


def check_values(args: argparse.Namespace) -> None:
    """Checks of option values that need zckpt's own rules, made before any file is read: a
    wrong value is a :class:`CommandLineError` (exit 2), as argparse's are."""
    if hasattr(args, "prefix") and args.prefix is None:  # MindFormers names its files without a prefix by default
        args.prefix = "" if getattr(args, "format", None) == "mindformers" else "checkpoint_"
    if getattr(args, "command", None) in ("export", "transform"):
        from zckpt.jobs.export_job import check_prefix  # export's modules (numpy): only for export, transform

        try:
            check_prefix(args.prefix)
        except UsageError as err:
            raise CommandLineError(f"--prefix: {err.message}") from None


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return n


def old_spelling(p: argparse.ArgumentParser, *names: str, like: argparse.Action) -> None:
    """Accept ``names`` as an older spelling of the option ``like``, hidden from the help (the
    generated reference lists them apart, see :func:`older_spellings`)."""
    kw: dict[str, Any] = {"dest": like.dest, "help": argparse.SUPPRESS, "default": like.default}
    if like.nargs == 0:  # store_true
        p.add_argument(*names, action="store_const", const=like.const, **kw)
    else:
        p.add_argument(*names, type=like.type or str, metavar=like.metavar, **kw)


_SPELLING_OF: weakref.WeakKeyDictionary[argparse.Action, str] = weakref.WeakKeyDictionary()


def old_positional(p: argparse.ArgumentParser, name: str, *, like: argparse.Action) -> None:
    """Accept a positional ``name`` as the older spelling of the option ``like`` (the command
    checks that at most one of them is given)."""
    action = p.add_argument(name, nargs="?", help=argparse.SUPPRESS)
    _SPELLING_OF[action] = like.option_strings[0]


def older_spellings(p: argparse.ArgumentParser) -> dict[str, str]:
    """``{older spelling: the option it stands for}`` of one (sub)command (a positional one as
    its name in capitals)."""
    shown = {a.dest: a.option_strings[0] for a in p._actions if a.help != argparse.SUPPRESS and a.option_strings}
    out: dict[str, str] = {}
    for a in p._actions:
        new = _SPELLING_OF.get(a) or shown.get(a.dest)
        if a.help == argparse.SUPPRESS and new:
            out.update((o, new) for o in (a.option_strings or [f"{a.dest.upper()} (positional)"]))
    return out


def _close(word: str, candidates: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


class Parser(argparse.ArgumentParser):
    """argparse with a suggestion for a misspelt command, choice or option."""

    def error(self, message: str) -> NoReturn:
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if bad:  # some Python versions quote the choices, others do not
            choices = re.findall(r"'([^']*)'", bad.group(2)) or [c.strip() for c in bad.group(2).split(",")]
            guess = _close(bad.group(1), choices)
            if guess:
                message += f"; did you mean '{guess}'?"
        vague = re.search(r"ambiguous option: (\S+) could match (.*)$", message)
        if vague:  # name the options the help shows, not their older spellings
            older = older_spellings(self)
            meant = list(dict.fromkeys(older.get(m, m) for m in vague.group(2).split(", ")))
            message = f"ambiguous option: {vague.group(1)} could match {', '.join(meant)}" if len(meant) > 1 else \
                f"ambiguous option: {vague.group(1)}; did you mean {meant[0]}?"
        super().error(message)

    def unrecognized(self, extras: list[str]) -> NoReturn:
        """Refuse arguments this (sub)command does not take, with the option meant where one is close."""
        words = []
        older = older_spellings(self)
        options = [o for a in self._actions for o in a.option_strings]
        for extra in extras:
            name = extra.split("=", 1)[0]
            guess = _close(name, options) if name.startswith("-") else None
            guess = older.get(guess, guess) if guess else None
            words.append(f"{extra} (did you mean {guess}?)" if guess else extra)
        self.error(f"unrecognized arguments: {' '.join(words)}")


class VersionAction(argparse.Action):
    """``--version``, the installed version looked up only when asked: ``importlib.metadata``
    (email, zipfile, ...) would otherwise cost every command's start ~15 ms."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show program's version number and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"zckpt {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # ~0.1 s to import: only for --version

    try:
        return version("zckpt")
    except PackageNotFoundError:
        return zckpt.__version__


def parse_storage_options(items: Sequence[str]) -> dict[str, Any]:
    """``["endpoint_url=http://h:9000", "anon=true"]`` -> ``{"endpoint_url": "http://h:9000", "anon": True}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CommandLineError(f"--storage-option wants KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out

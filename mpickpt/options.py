"""Command-line options declared once, on the config dataclasses they fill.

A config field becomes a flag when it is declared with `option(...)`: its docstring (the string
literal under it in the class body) is the help text, its default is shown in `--help`, and its
`parse` function turns the flag's text into the value (raising `argparse.ArgumentTypeError` with
what was expected). `add_options(parser, Config, groups)` adds the class's flags to argument
groups; `values_from(Config, args)` returns the parsed field values, ready for `Config(**values)`,
whose `__post_init__` checks them together. Local: nothing here uses MPI.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import textwrap

_KEY = "mpickpt.option"


def option(default=dataclasses.MISSING, *, flag: str | None = None, parse=None, choices=None,
           metavar: str | None = None, group: str | None = None, switch: bool = False):
    """A dataclass field that is also a command-line flag. Local.

    `flag` defaults to the field name with dashes; `switch` makes a flag without value (True when
    given); `group` overrides the class's `OPTION_GROUP` for this flag."""
    meta = {"flag": flag, "parse": parse, "choices": choices, "metavar": metavar,
            "group": group, "switch": switch}
    return dataclasses.field(default=default, metadata={_KEY: meta})


def field_docs(cls) -> dict[str, str]:
    """Field name -> the docstring written under it, for `cls` and its bases. Local."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def option_fields(cls) -> list[tuple[dataclasses.Field, dict]]:
    """(field, option metadata) of every field of `cls` declared with `option`. Local."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def flag_of(f: dataclasses.Field, meta: dict) -> str:
    return meta["flag"] or "--" + f.name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, cls, groups: dict) -> None:
    """Add one flag per option field of `cls` to `groups[name]` (argument groups by concern; the
    name is the field's `group` or the class's `OPTION_GROUP`). Local."""
    docs = field_docs(cls)
    for f, meta in option_fields(cls):
        target = groups.get(meta["group"] or cls.OPTION_GROUP, parser)
        text = docs.get(f.name, "")
        kwargs = {"dest": _dest(cls, f), "default": f.default, "help": _help(text, f.default, meta)}
        if meta["switch"]:
            kwargs["action"] = "store_true"
        else:
            flag = flag_of(f, meta)
            metavar = None if meta["choices"] else (
                meta["metavar"] or flag.lstrip("-").upper().replace("-", "_"))
            kwargs.update({"type": _reported(meta["parse"] or str),
                           "choices": meta["choices"], "metavar": metavar})
        target.add_argument(flag_of(f, meta), **kwargs)


def _reported(parse):
    """`parse`, with a ValueError's own message kept in argparse's error (argparse replaces it
    with 'invalid value' otherwise)."""
    def wrapped(text: str):
        try:
            return parse(text)
        except argparse.ArgumentTypeError:
            raise
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    wrapped.__name__ = getattr(parse, "__name__", "value")
    return wrapped


def values_from(cls, args: argparse.Namespace) -> dict:
    """The parsed values of `cls`'s option fields, keyed by field name. Local."""
    return {f.name: getattr(args, _dest(cls, f)) for f, _ in option_fields(cls)}


def changed_flags(cls, values, names=None) -> list[str]:
    """The flags of `cls`'s option fields (those in `names`, else all) whose value in `values`
    (a dict by field name, or an instance of `cls`) differs from the field's default: the flags
    the user set. Local."""
    get = values.get if isinstance(values, dict) else lambda n: getattr(values, n)
    return [flag_of(f, meta) for f, meta in option_fields(cls)
            if (names is None or f.name in names) and f.default is not dataclasses.MISSING
            and get(f.name) != f.default]


def only_applies(stray: list[str], where: str, this: str) -> str:
    """The refusal of flags `stray` given where they do not apply: 'F only applies to WHERE;
    THIS would ignore it' (plural for several). Local."""
    one = len(stray) == 1
    return (f"{', '.join(stray)} only {'applies' if one else 'apply'} to {where}; {this} would "
            f"ignore {'it' if one else 'them'}")


def _dest(cls, f: dataclasses.Field) -> str:
    return f"{cls.__name__}__{f.name}"


def _help(text: str, default, meta: dict) -> str:
    # argparse expands '%' in help strings
    text = text.replace("%", "%%")
    if meta["switch"] or default is None or default is dataclasses.MISSING:
        return text
    return f"{text} (default: {default})" if text else f"(default: {default})"


# ---- parsers for flag values (argparse reports the flag with the message) ---------------------
def int_at_least(low: int):
    """A parser of integers >= `low`. Local."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """A finite number > 0. Local."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0. Local."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def ratio(text: str) -> float:
    """A number in [0, 1]. Local."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


class OutputError(ValueError):
    """An output flag names a place the run cannot write."""


def check_output(flag: str, path: str | None, folder: bool) -> None:
    """An output the run writes at its end (or as it goes) can be written there: OutputError
    naming `flag` before any work otherwise. A file's directory must exist and be writable (a
    file is written beside itself and renamed over); a `folder` may be missing with its
    parents, under a writable nearest existing one. Local."""
    if path is None:
        return
    if os.path.isdir(path) != folder and os.path.exists(path):
        raise OutputError(f"{flag} {path}: exists and is {'not ' if folder else ''}a directory")
    target = path if folder and os.path.exists(path) else os.path.dirname(os.path.abspath(path))
    if folder:
        while not os.path.exists(target):
            target = os.path.dirname(target)
        if not os.path.isdir(target):
            raise OutputError(f"{flag} {path}: {target} exists and is not a directory")
    elif not os.path.isdir(target):
        raise OutputError(f"{flag} {path}: its directory {target} "
                          + ("exists and is not a directory" if os.path.exists(target)
                             else "does not exist"))
    if not os.access(target, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: {target} is not writable")

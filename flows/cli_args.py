"""The CLI's numeric options and its one-line usage errors, shared by `atelier` (flows/cli.py) and the flows' own
`python -m` commands: an option declared with `number` carries the Bounds it accepts, `check_numbers` names the first
value outside them, and OneLineParser prints argparse's own errors as one `atelier: error:` line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    """The values a numeric option accepts: ``low`` (excluded when ``low_open``) to ``high`` (None: no limit)."""

    low: float
    high: float | None = None
    low_open: bool = False
    meaning: str = ""  # what the number is, for the error line

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.high is None:
            return f"must be {'>' if self.low_open else '>='} {self.low:g}"
        return f"must be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


SEED = Bounds(0, 2**63 - 1, meaning="the random seed")
STEPS = Bounds(1, meaning="Euler steps per image")
GUIDANCE = Bounds(0, meaning="classifier-free guidance scale")
SHARD_SIZE = Bounds(1, meaning="samples per shard")


def number(sp: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str, type: type, bounds: Bounds,
           **kwargs) -> argparse.Action:
    """A numeric option with the values it accepts; `check_numbers` turns any other into a UsageError naming it.

    Every int or float option of the parser is declared through here (tests/test_bad_input.py walks them all
    through 0, negative and out-of-range values, and fails on a numeric option without bounds).
    """
    action = sp.add_argument(*flags, type=type, **kwargs)
    action.bounds = bounds
    return action


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The sub-parser that parsed ``args`` (`designer generate`'s, `eval`'s, ...)."""
    for dest in ("group", "command"):
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, dest, None) is None:
            break
        parser = sub.choices[getattr(args, dest)]
    return parser


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A UsageError naming the first numeric option whose value is outside its Bounds."""
    from atelier_studio.pipeline.errors import UsageError

    for action in command_parser(parser, args)._actions:
        bounds: Bounds | None = getattr(action, "bounds", None)
        value = getattr(args, action.dest, None)
        if bounds is not None and value is not None and not bounds.holds(value):
            meaning = f" ({bounds.meaning})" if bounds.meaning else ""
            raise UsageError(f"{action.option_strings[0]} {value}: {bounds.describe()}{meaning}")


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a missing option, a word where a number goes) are one line too, as
    every other error of the CLI, instead of the usage text and the error; `--help` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"atelier: error: {self.prog}: {message} (see `{self.prog} --help`)\n")

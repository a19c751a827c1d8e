"""The words of `nightshift --help`: what the tool is, and what each exit status means."""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from jobs.contract import ExitCode

DESCRIPTION = """\
nightshift: scheduled continual fine-tuning for one GPU workstation. Every night, inside a
configured window, it pulls the data that arrived, plans what fits in the time left from the
throughput it measured, trains a LoRA adapter from the one in service, evaluates it, publishes
it as an immutable version and hot-swaps it into the inference server.

Start with `nightshift once` (one night now), `nightshift status`, `nightshift validate FILE`
and `nightshift report`; `nightshift run` is the service systemd starts."""

# What each exit status (ExitCode in jobs/contract/basics.py) means, in words: `--help` and the README print these.
EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "done (a night that was skipped or rejected by the gate also ends with 0)",
    ExitCode.FAILED: "the night or the command failed (`validate`: at least one record would be quarantined)",
    ExitCode.USAGE: "bad command line or bad config: every problem is printed",
    ExitCode.INTERRUPTED: "stopped on request; the checkpoint is saved and the next start resumes",
    ExitCode.HOTSWAP_FAILED: "published, but at least one inference server did not take it (`once`, `adapters "
                             "promote`/`rollback`, `hotswap`); the version stays in service, `nightshift hotswap` "
                             "re-sends it",
    ExitCode.BUSY: "another nightshift process holds the state directory",
}


def exit_codes_help() -> str:
    return "exit status:\n" + "\n".join(f"  {int(c)}  {EXIT_CODE_MEANINGS[c]}" for c in EXIT_CODE_MEANINGS)


class CommandParser(argparse.ArgumentParser):
    """argparse with "did you mean" for a misspelt command or choice (`nightshift onse`), as config keys have
    (Python 3.14's `suggest_on_error`, on every Python this supports); its subcommands' parsers are of this class."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1)
            if hint:
                choices = ", ".join(repr(str(c)) for c in action.choices)
                raise argparse.ArgumentError(action, f"invalid choice: {value!r} (did you mean {hint[0]!r}? "
                                                     f"choose from {choices})")
        super()._check_value(action, value)

"""Every command's ``--help``: each flag and argument says what it is, and the command says its exit statuses.

Walks the real parsers (the top-level command's and each subcommand's, the ones that read their own arguments
after it, and the probe script's), so a flag added without help fails here, not in a user's terminal.
"""

import argparse

import pytest

from nnsight_repro import cli, wheel
from nnsight_repro.ndif import cli as ndif_cli
from nnsight_repro.ndif import negative_control, panel
from nnsight_repro.ndif.feasibility import runner
from nnsight_repro.preflight import cli as preflight_cli

#: Parsers that read their own arguments, by the command a user types.
OWN_PARSERS = {
    "nnsight-repro": cli.parser,
    "nnsight-repro ndif": ndif_cli.parser,
    "nnsight-repro ndif panel": panel.parser,
    "nnsight-repro ndif negative-control": negative_control.parser,
    "nnsight-repro wheel": wheel.parser,
    "nnsight-repro preflight": preflight_cli.parser,
    "probe_ndif.py": runner.parser,
}


def commands():
    """``(name, parser)`` for every parser and subparser, subcommands after their parent."""
    found = []

    def walk(name, parser):
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(f"{name} {sub_name}", sub)

    for name, make in OWN_PARSERS.items():
        walk(name, make())
    return found


COMMANDS = commands()
#: Subcommands whose arguments another parser reads (`--help` included): they show only a one-line help.
PASSED_ON = {name for name, parser in COMMANDS if not parser.add_help}


@pytest.mark.parametrize("name,parser", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_argument_of_every_command_has_help(name, parser):
    bare = [action.dest for action in parser._actions
            if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert bare == []


@pytest.mark.parametrize("name,parser", [(n, p) for n, p in COMMANDS if n not in PASSED_ON],
                         ids=[n for n, _ in COMMANDS if n not in PASSED_ON])
def test_every_command_lists_its_exit_statuses_in_its_help(name, parser):
    assert "exit status" in parser.format_help()


def subcommands(parser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_the_top_level_help_names_every_ndif_subcommand():
    ndif_help = next(a.help for a in subcommands(cli.parser())._choices_actions if a.dest == "ndif")
    assert [name for name in subcommands(ndif_cli.parser()).choices if name not in ndif_help] == []


def test_the_wheel_help_says_it_compiles_a_c_extension():
    assert "compiles nnsight's C extension" in wheel.parser().format_help()

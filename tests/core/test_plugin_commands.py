"""A plugin's own ``nrl convert`` subcommands (``nrl_commands``, contract 8): added to the parser,
run with their arguments, their errors one line; a command that names an unknown group or a name
already taken is skipped with a warning and ``nrl`` keeps working."""

from __future__ import annotations

import argparse
import logging

import pytest

from nrl_core import hookimpl
from nrl_core.cli import EXIT_USAGE, main
from nrl_core.contracts import CommandSpec
from nrl_core.errors import NrlError
from nrl_core.plugins import get_plugin_manager

RAN: list[argparse.Namespace] = []


def shout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("word")
    parser.add_argument("--times", type=int, default=1)


def shout(args: argparse.Namespace) -> int:
    if args.word == "bad":
        raise NrlError("bad: not a word\nsecond line")
    RAN.append(args)
    print(" ".join([args.word.upper()] * args.times))
    return 0


def spec(name: str, group: str = "convert", arguments: str = f"{__name__}:shout_arguments") -> CommandSpec:
    return CommandSpec(name=name, group=group, arguments=arguments, entry=f"{__name__}:shout",
                       distribution="nrl-shout", help="say it louder")


class Commands:
    NRL_CONTRACT = 8

    def __init__(self, *specs: CommandSpec) -> None:
        self.specs = list(specs)

    @hookimpl
    def nrl_commands(self) -> list[CommandSpec]:
        return self.specs


def test_a_plugin_command_runs_with_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    RAN.clear()
    with get_plugin_manager().registered(Commands(spec("shout")), name="shout"):
        assert main(["convert", "shout", "hello", "--times", "2"]) == 0
    assert capsys.readouterr().out.strip() == "HELLO HELLO"
    assert RAN[0].word == "hello" and RAN[0].times == 2


def test_a_plugin_commands_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with get_plugin_manager().registered(Commands(spec("shout")), name="shout"):
        assert main(["convert", "shout", "bad"]) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == "error: bad: not a word second line"


def test_unknown_groups_taken_names_and_broken_arguments_are_skipped(caplog: pytest.LogCaptureFixture,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    plugin = Commands(spec("elsewhere", group="train"), spec("checkpoint"),
                      spec("broken", arguments=f"{__name__}:no_such_function"), spec("shout"))
    with get_plugin_manager().registered(plugin, name="shout"), caplog.at_level(logging.WARNING):
        assert main(["convert", "shout", "still"]) == 0
        with pytest.raises(SystemExit):
            main(["convert", "broken", "x"])
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "command 'elsewhere' of nrl-shout is not added: its group 'train' is not one of convert" in warnings
    assert "command 'checkpoint' of nrl-shout is not added: nrl convert checkpoint exists already" in warnings
    assert "command 'broken' of nrl-shout is not added: its arguments" in warnings
    assert "STILL" in capsys.readouterr().out


def test_the_megatron_backend_adds_its_conversions() -> None:
    pytest.importorskip("nrl_backend_megatron")
    registry = get_plugin_manager().commands()
    assert {"hf-to-megatron", "megatron-to-hf"} <= set(registry.names())
    assert registry.owner("hf-to-megatron") == "megatron"

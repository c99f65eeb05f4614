"""`hylo --help` for every subcommand: each option has help text that says its default at most once,
and the flags renamed or aliased keep their old spellings."""

from __future__ import annotations

import argparse
import re

from hylo.cli import _build_parser, _sampling_params


def _parsers(parser: argparse.ArgumentParser, path: str = "hylo"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _options():
    for path, parser in _parsers(_build_parser()):
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                formatter = parser._get_formatter()
                formatter.add_argument(action)
                yield f"{path} {action.option_strings[0]}", action, formatter.format_help()


def test_every_option_has_help_that_says_its_default_once():
    options = list(_options())
    assert len(options) > 100  # every subcommand walked (generate and serve carry the engine flags)
    no_help = [name for name, action, _ in options if not (action.help or "").strip()]
    assert not no_help, f"options without help text: {no_help}"
    twice = [name for name, _, text in options if len(re.findall(r"\bdefault\b", text, re.IGNORECASE)) > 1]
    assert not twice, f"help that says the default twice: {twice}"
    helps = {name: text for name, _, text in options}
    assert "(default: 8000)" in helps["hylo serve --port"]  # a default the help does not say is added
    assert "(default: None)" not in "".join(helps.values())  # an unset default says nothing
    assert "(default: False)" not in "".join(helps.values())


def test_generate_has_one_seed_and_keeps_the_old_name():
    parser = _build_parser()
    seeds = [a for a in parser.parse_args(["generate", "--prompt", "x"]).__dict__ if "seed" in a]
    assert sorted(seeds) == ["sampling_seed", "seed"]  # the engine's seed stays set (to its default)
    for flag in ("--seed", "--sampling-seed"):
        args = parser.parse_args(["generate", "--prompt", "x", "--temperature", "1", flag, "7"])
        assert _sampling_params(args).seed == 7, flag
    gen_flags = {
        s
        for _, parser in _parsers(parser)
        if parser.prog.endswith("generate")
        for s in parser._option_string_actions
    }
    assert {"--seed", "--sampling-seed"} <= gen_flags
    assert _sampling_params(parser.parse_args(["generate", "--prompt", "x"])).seed is None


def test_bench_serve_takes_vllms_dataset_flag_and_the_old_one():
    parser = _build_parser()
    for flag in ("--dataset-name", "--dataset"):
        args = parser.parse_args(["bench", "serve", "--base-url", "http://x", flag, "random"])
        assert args.dataset == "random", flag

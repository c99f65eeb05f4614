"""Benchmarks users run against hylo and other servers (`hylo bench serve`).

Layer: with `server` and `llm`, below `cli` (see `hylo`'s docstring).
"""

"""Benchmarks users run against hylo and other servers."""

"""OpenAI-compatible server (`hylo serve`) over one engine.

Layer: with `llm` and `bench`, below `cli`, above `distributed` and `engine` (see `hylo`'s docstring).
"""

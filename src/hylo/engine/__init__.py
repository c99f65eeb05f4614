"""The engine: requests in, tokens out, one scheduled step at a time (`engine.Engine`), and what it
owns: the scheduler, the runner of one step on the device and its helpers (batch, picks, the draft
driver, the read, the sampling batch), the CUDA-graph banks and step shapes.

Layer: below `distributed`, `server`, `llm` and `bench`; above `speculative`, `models`, `memory`,
`parallel` (see `hylo`'s docstring). It is given its ranks (`hylo.parallel.ranks.Ranks`) and never
starts them.
"""

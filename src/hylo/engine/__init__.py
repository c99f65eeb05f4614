"""The engine: requests in, tokens out, one scheduled step at a time (`engine.Engine`), and what it
owns: the scheduler, the runner of one step on the device and its helpers (batch, picks, the draft
driver, the read, the sampling batch), the CUDA-graph banks and step shapes.

Layer: below `distributed`, `server`, `llm` and `bench`; above `speculative`, `models`, `memory`,
`parallel` (see `hylo`'s docstring). It is given its ranks (`hylo.parallel.ranks.Ranks`) and never
starts them.

Who owns what:
- the scheduler (`scheduler.py`) owns request state: which requests run in a step and how many
  tokens each feeds (`chunk.ScheduledChunk`), admission, pages, preemption; and, through its
  in-flight ledger (`ledger.py`), what is launched and not yet read: the ledger alone writes a
  request's in-flight counters and alone decides whether a step may run ahead of the read before it
  (a `route.RunAhead`, with its reason when refused);
- the runner (`runner.py`) launches a step on the route picked for it once (`route.py`: eager, or a
  decode-, verify- or prefill-graph replay) and collects its one read into one result per chunk;
  how a launched step picks is one of a closed set (`launched.py`); what the logits become is
  `picking.py`'s, over a sampling batch built once per step (`sampling_batch.py`);
- the draft driver (`drafting.py`) owns every proposer call and the decode graphs' deferred ring;
- the reader (`reader.py`) owns the pinned buffers of the one device-to-host read per step;
- the graph bank (`graph_bank.py`) owns captures, replays and their memory pool, composed with a step
  shape (`cuda_graph.py`: decode, `verify_graph.py`, `prefill_graph.py`);
- the engine (`engine.py`) owns the requests by id and the step loop (schedule-next, launch,
  settle-previous); `builder.py` builds its parts once, and `warmup.py` runs one eager step of each
  shape class in the scratch slot before the engine is ready (kernels compiled at start-up).
"""

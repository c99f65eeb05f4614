"""`hylo serve` with faults planted, for the robustness tests: a prompt that starts with one of these
token sequences fails its output bookkeeping (the failure of one request), makes the engine step
raise (an engine that cannot continue), or makes the step hang (a stuck engine). A request with
`max_tokens == SCRIPTED_MAX_TOKENS` replies `SCRIPTED_REPLY` instead of the model's text, one piece a
token (the tags split across pieces), for the reasoning and tool-call parsers."""

from __future__ import annotations

import sys
import time

from hylo.cli import main
from hylo.engine.request import Request
from hylo.engine.scheduler import Scheduler

POISON_OUTPUT = [300, 301, 302]
POISON_STEP = [310, 311, 312]
POISON_HANG = [320, 321, 322]
SCRIPTED_MAX_TOKENS = 777
SCRIPTED_REPLY = [
    "<thi", "nk>The user asks for", " weather.</th", "ink>Checking", " now.<tool", "_call>get_weather\n",
    "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3",
    "</arg_value>\n</tool_call>", "<tool_call>get_time\n<arg_key>zone</arg_key><arg_value>CET</arg_value>",
    "</tool_call>",
]  # fmt: skip


def _starts(ids: list[int], poison: list[int]) -> bool:
    return ids[: len(poison)] == poison


def _plant() -> None:
    append, schedule = Request.append, Scheduler.schedule

    def failing_append(self: Request, token, logprobs):
        if _starts(self.prompt_ids, POISON_OUTPUT):
            raise RuntimeError("planted fault in one request's output")
        if self.params.max_tokens == SCRIPTED_MAX_TOKENS:
            # the script alone ends the reply: a sampled eos (a request without ignore_eos, as every
            # /v1/messages one) cut ~7% of them short, failing the tests that read the whole script
            self.stop_ids = frozenset()
            append(self, token, logprobs)  # its bookkeeping; the text is the script's
            k = len(self.output_ids) - 1
            piece = SCRIPTED_REPLY[k] if k < len(SCRIPTED_REPLY) else ""
            if k >= len(SCRIPTED_REPLY) - 1:
                self.text = "".join(SCRIPTED_REPLY[:k])
                return self._finish("stop", piece)
            return piece
        return append(self, token, logprobs)

    def failing_schedule(self: Scheduler, *args, **kwargs):
        chunks = schedule(self, *args, **kwargs)
        if any(_starts(ch.request.prompt_ids, POISON_STEP) for ch in chunks):
            raise RuntimeError("planted fault in the engine step")
        if any(_starts(ch.request.prompt_ids, POISON_HANG) for ch in chunks):
            time.sleep(3600)
        return chunks

    Request.append = failing_append
    Scheduler.schedule = failing_schedule


if __name__ == "__main__":
    _plant()
    raise SystemExit(main(sys.argv[1:]))

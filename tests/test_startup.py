"""Start-up cost: building and running an engine never imports torch._dynamo, whose import alone
costs seconds in every process that starts one (each `hylo serve`, each rank, each CLI call)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_an_engine_starts_and_generates_without_importing_dynamo(model_dir):
    script = textwrap.dedent(
        f"""
        import sys
        from hylo import LLM, SamplingParams
        llm = LLM(model={str(model_dir)!r}, device="cpu", dtype="float32", page_size=16, max_memory_gb=0.25)
        two = SamplingParams(max_tokens=2, ignore_eos=True)  # two tokens, whatever is sampled
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=two)
        assert len(out[0].token_ids) == 2
        print("dynamo imported:", "torch._dynamo" in sys.modules)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "dynamo imported: False" in run.stdout, run.stdout

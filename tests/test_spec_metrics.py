"""Speculative decoding's acceptance where users look for it (issue 43, item 5): vLLM's spec-decode
counters (drafts, draft tokens, accepted tokens, accepted per position) with the mean acceptance
length and per-position acceptance rates in /metrics, and SGLang's avg_spec_accept_length in
/server_info, all telling the same story."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families
from test_spec import BLOCK, dflash_server, draft, target  # noqa: F401 (fixtures)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_spec_decode_metrics_agree_with_server_info(target, draft):  # noqa: F811
    with dflash_server(target, draft) as client:
        before = _samples(client.get("/metrics").text)
        assert before[("hylo_spec_decode_num_drafts_total", ())] == 0
        assert math.isnan(before[("hylo_spec_decode_mean_acceptance_length", ())])
        for prompt in ([5, 6, 7, 8, 9], [9, 3, 3, 1]):
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
        m = _samples(client.get("/metrics").text)
        drafts = m[("hylo_spec_decode_num_drafts_total", ())]
        draft_tokens = m[("hylo_spec_decode_num_draft_tokens_total", ())]
        accepted = m[("hylo_spec_decode_num_accepted_tokens_total", ())]
        # a fixed draft length without the adaptive policy, shorter only near a request's max_tokens
        assert drafts > 0 and accepted <= draft_tokens <= drafts * (BLOCK - 1)
        assert draft_tokens > drafts * (BLOCK - 2)
        per_pos = [
            m.get(("hylo_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),)), 0)
            for p in range(BLOCK - 1)
        ]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
        tau = m[("hylo_spec_decode_mean_acceptance_length", ())]
        assert math.isclose(tau, 1 + accepted / drafts)
        info = client.get("/server_info").json()
        assert math.isclose(info["avg_spec_accept_length"], tau)
        rates = [m[("hylo_spec_decode_acceptance_rate", (("position", str(p)),))] for p in range(BLOCK - 1)]
        assert info["spec_accept_rate_per_pos"] == rates and "spec_adaptive_steps" not in info
        assert math.isclose(rates[0], per_pos[0] / drafts)  # every verify step checks a first draft
        assert all(0 <= r <= 1 for r in rates) and rates[-1] >= per_pos[-1] / drafts

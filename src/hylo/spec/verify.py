"""Accepting draft tokens: greedy prefix match, or lossless rejection sampling for one-hot drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.engine.request import Request
from hylo.sampling import SampleRow, target_distribution


@dataclass
class Verdict:
    """`tokens` = the accepted drafts followed by one token from the target (the bonus, or the
    replacement of the first rejected draft); `accepted` = how many drafts were kept."""

    accepted: int
    tokens: list[int]
    logprobs: list[dict[int, float]] | None = None


def verify(
    logits: torch.Tensor,
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
    generator: torch.Generator | None,
) -> list[Verdict]:
    """`logits` holds, request after request, the target's logits at the anchor and each draft
    (`len(drafts[r]) + 1` rows). Position i's distribution is processed as if i tokens had already
    been generated (so `min_tokens` bans move along the block).

    Greedy requests keep the longest prefix of drafts equal to the target's argmax, then take the
    argmax after it. Sampled requests accept draft x with probability p(x) under the target's
    processed distribution p; the first rejection is replaced by a sample from p with x removed and
    renormalised; if all drafts pass, the bonus is sampled from p. Either way the committed tokens
    are distributed exactly as plain sampling would make them. One device-to-host read per call.
    """
    rows = [_row(r, i) for r, d in zip(requests, drafts, strict=True) for i in range(len(d) + 1)]
    processed, probs = target_distribution(logits, rows)
    draft_ids = torch.tensor([x for d in drafts for x in (*d, 0)], device=logits.device)
    noise_u, noise_e = _noise(requests, drafts, probs, generator)
    accept = noise_u < probs.gather(1, draft_ids[:, None])[:, 0]
    residual = probs.scatter(1, draft_ids[:, None], 0.0)
    picks = torch.stack([
        processed.argmax(-1),  # greedy target token
        (probs / noise_e).argmax(-1),  # sample from p (exponential race)
        (residual / noise_e).argmax(-1),  # sample from p without the draft token
    ]).tolist()  # fmt: skip
    accept_list = accept.tolist()

    verdicts, row = [], 0
    for request, draft in zip(requests, drafts, strict=True):
        greedy = request.params.greedy
        tokens: list[int] = []
        for i, x in enumerate(draft):
            r = row + i
            if (picks[0][r] == x) if greedy else accept_list[r]:
                tokens.append(x)
                continue
            tokens.append(picks[0][r] if greedy else picks[2][r])
            break
        else:
            last = row + len(draft)
            tokens.append(picks[0][last] if greedy else picks[1][last])
        verdicts.append(
            Verdict(len(tokens) - 1, tokens, _logprobs(logits[row : row + len(tokens)], tokens, request))
        )
        row += len(draft) + 1
    return verdicts


def _logprobs(logits: torch.Tensor, tokens: list[int], request: Request) -> list[dict[int, float]] | None:
    """Top-n logprobs of the raw distribution at each committed position, the token itself included."""
    n = request.params.logprobs
    if n is None:
        return None
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = logprobs.topk(n, dim=-1) if n else None
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    out = []
    for i, token in enumerate(tokens):
        entry = (
            dict(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True)) if top is not None else {}
        )
        entry[token] = chosen[i]
        out.append(entry)
    return out


def _row(request: Request, ahead: int) -> SampleRow:
    banned = sorted(request.stop_ids) if len(request.output_ids) + ahead < request.params.min_tokens else []
    return SampleRow(request.params, request.prompt_ids, request.output_ids, request.generator, banned)


def _noise(requests, drafts, probs: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms for the accept tests and Exp(1) noise for the samples, drawn from each request's
    own generator when it has one (so a seeded request does not depend on its batch)."""
    uniforms, exps = [], []
    vocab, device = probs.shape[1], probs.device
    for request, draft in zip(requests, drafts, strict=True):
        gen = request.generator or generator
        n = len(draft) + 1
        uniforms.append(torch.rand(n, device=device, generator=gen))
        exps.append(torch.empty(n, vocab, device=device).exponential_(generator=gen))
    return torch.cat(uniforms), torch.cat(exps)

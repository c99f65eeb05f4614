"""Structured outputs: a JSON schema, a regular expression or an EBNF grammar constrains what a request
may sample, through `xgrammar` (its compiled grammars cached per engine, one matcher per sequence).

Per step, the host fills each constrained row's bitmask of allowed tokens from its matcher (after the
tokens of every earlier step were accepted into it), uploads the bitmasks from pinned memory, and the
sampler masks the processed logits on the device (`allowed_tokens`: a torch unpacking of the bits, the
reference on every device). After the step's read each sampled token is accepted into its matcher; a
matcher that has reached the end of its grammar ends the request (`stop`).

Speculative decoding: a constrained request's drafts come back with the step's one read (they are
made on the device), and its next verify block is masked position by position with the drafts before
each position accepted into its matcher and rolled back (`block_bitmasks`): a draft the grammar
refuses is rejected like any other, and the accepted tokens and the bonus all match. A proposer that
drafts on the host (`needs_host`) leaves its constrained requests without drafts: they decode one
token a step.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hylo.host_copy import to_device

if TYPE_CHECKING:
    import xgrammar

    from hylo.sampling import SamplingParams
    from hylo.tokenizer import Tokenizer

# How many compiled grammars an engine keeps (xgrammar's cache, counted in bytes there).
GRAMMAR_CACHE_BYTES = 256 * 2**20


# JSON outputs are compact (no whitespace after `,` or `:`; xgrammar's default without free
# whitespace is `", "` and `": "`): the fewest tokens, and what `json.dumps(separators=COMPACT)` writes.
COMPACT = (",", ":")


def xgrammar_message(exc: Exception) -> str:
    """The first line of an xgrammar error, without the "[time] source.cc:line: " it starts with."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip().splitlines()[0])


class GrammarError(ValueError):
    """A constraint that does not compile: the message names the sampling field."""


class Grammars:
    """Compiles the constraint of a request's `SamplingParams` against one model's vocabulary.

    Invariant: `vocab_size` is the model's logits width (at least the tokenizer's); ids past the
    tokenizer's and its special tokens never match text, only `stop_ids` end a grammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        import xgrammar

        special = set(tokenizer.special_ids())
        encoded = [b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
        )
        self.vocab_size = vocab_size
        self.compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def compile(self, params: SamplingParams) -> xgrammar.CompiledGrammar:
        """The compiled constraint of `params` (which has one), or a GrammarError naming its field."""
        kind, text = params.constraint
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(text, any_whitespace=False, separators=COMPACT)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(text)
        except RuntimeError as exc:  # xgrammar reports a bad constraint as a RuntimeError
            raise GrammarError(f"{kind}: {xgrammar_message(exc)}") from exc

    @staticmethod
    def matcher(compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask (bit t of word t // 32: token t is allowed)."""
    return (vocab_size + 31) // 32


def fill_bitmasks(
    matchers: Sequence[xgrammar.GrammarMatcher | None], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """The allowed-token bitmasks of a batch's rows on `device` (`[rows, bitmask_words]`, a row
    without a matcher allows everything); None when no row has one."""
    if all(m is None for m in matchers):
        return None
    host = torch.full((len(matchers), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill_next_token_bitmask(host, row)
    return to_device(host, device)


def block_bitmasks(
    blocks: Sequence[tuple[xgrammar.GrammarMatcher | None, Sequence[int]]],
    width: int,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The bitmasks of verify blocks of `width` positions, `[blocks · width, words]` on `device`, from
    each block's (matcher, drafts): position i allows what the grammar allows after drafts 0 .. i-1
    (accepted into the matcher, then rolled back); past a draft the grammar refuses (which is then
    never accepted), and in a block without a matcher, everything. None when no block has one."""
    if all(matcher is None for matcher, _ in blocks):
        return None
    host = torch.full((len(blocks) * width, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for b, (matcher, drafts) in enumerate(blocks):
        if matcher is None:
            continue
        taken = 0
        for i in range(width):
            matcher.fill_next_token_bitmask(host, b * width + i)
            if i == width - 1 or i >= len(drafts) or not matcher.accept_token(drafts[i]):
                break
            taken += 1
            if matcher.is_terminated():
                break
        if taken:
            matcher.rollback(taken)
    return to_device(host, device)


def allowed_tokens(bitmasks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[rows, vocab_size]` bool from `[rows, words]` int32 bitmasks."""
    ids = torch.arange(vocab_size, device=bitmasks.device)
    words = bitmasks[:, ids // 32]
    return ((words >> (ids % 32).to(torch.int32)) & 1).bool()

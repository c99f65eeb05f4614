"""MTP proposer: keeps the MTP layer's DSA caches for every committed token and drafts by chaining
`num_steps` MTP forwards from the anchor."""

from __future__ import annotations

from pathlib import Path

import torch

from hylo.forward_batch import ForwardBatch, Padded, SequenceChunk, Uniform
from hylo.host_copy import to_device
from hylo.layers.vocab import HotTokenHead, VocabHead
from hylo.memory.specs import TokenCacheSpec
from hylo.memory.state import StateCache
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import load_mtp_layer
from hylo.models.mtp import MTPLayer
from hylo.ops.mtp_inputs import VerifiedBlocks, block_inputs
from hylo.speculative.proposer import Proposer, ProposerBuild, ProposerCaches, StepCommit
from hylo.speculative.verify import VerifyShape


class MTPProposer(Proposer):
    """The MTP layer's latents, indexer keys, gates and pooled keys live in a `TokenCache` of their own
    indexed by the target's request table, with the entry for (h_i, token i+1) at position i (see
    `hylo.models.mtp`). `last_hidden[row]` keeps the target hidden of each request's last committed
    token, which pairs with the next token to arrive. Everything runs from device tensors (a verify
    graph captures the observe and the `num_steps` chained drafting forwards, a prefill graph the
    observe of its padded chunk).

    Invariant: after `observe`, a request with n committed tokens has correct entries at positions
    0 .. n-2 (after `observe_and_propose`, 0 .. n-1). Observe writes an entry for every token of the
    forward, committed or not (a rejected draft's is wrong), and drafting writes positions n-1 ..
    n-2+steps; any entry at n-1 or later is rewritten, by a later observe or draft, before a query
    reads it (queries at n-1+s read positions up to n-1+s, and observes write in order), and a
    k-pool completed by a wrong entry is recompressed when its last entry is written again, exactly
    as the target's own caches roll back.
    """

    needs_host = False
    needs_last_features = True
    # a prefill graph's chunk is observed in a padded MTP batch of its width (`_observe_padded`);
    # `_keep_last_hidden` and `propose` read its first token's position and `counts` alone
    observes_padded = True

    def __init__(
        self,
        layer: MTPLayer,
        target: Glm5NextForCausalLM,
        caches: ProposerCaches,
        num_steps: int = 1,
        head: VocabHead | HotTokenHead | None = None,
    ):
        """`caches.pools[0]`: the MTP layer's `TokenCache` (from `TokenCacheSpec(layer.config, ...)`);
        `head`: what drafts are picked with (default the layer's head; a token map's `HotTokenHead`)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.layer, self.target = layer, target
        self.head = layer.head(target) if head is None else head
        self.num_steps = num_steps  # one draft each: the verify block is the anchor and num_steps drafts
        self.verify_shape = VerifyShape(num_steps + 1)
        self.capture_layers = (target.config.num_hidden_layers - 1,)
        weight = target.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        # The MTP layer has no KDA state; a forward batch still carries a (here empty) state cache.
        self.states = StateCache(layer.config, 0, self.dtype, self.device)
        (self.cache,) = caches.pools
        self.table, self.drafts = caches.req_to_token, caches.drafts
        self.last_hidden = torch.zeros(
            self.table.shape[0], target.config.hidden_size, dtype=self.dtype, device=self.device
        )

    @classmethod
    def load(
        cls,
        path: str | Path,
        target: Glm5NextForCausalLM,
        num_steps: int = 1,
        indexer_dtype: torch.dtype | None = None,
        random_weights: bool = False,
        token_map: torch.Tensor | None = None,
    ) -> ProposerBuild:
        """The MTP layer of the target checkpoint at `path` (with `random_weights`, built from its
        config alone with the seeded random init, as `load_format="dummy"` asks); the proposer is
        built around the layer's token cache (pooled keys in `indexer_dtype`) once the plan allocates it."""
        layer = load_mtp_layer(path, target, random_weights=random_weights)
        # made before the memory plan, which then counts its copy of the map's head rows
        head = None if token_map is None else layer.head(target).restricted(token_map)
        spec = TokenCacheSpec(
            layer.config, target.embed_tokens.weight.dtype, indexer_dtype, name="mtp_tokens"
        )
        build = lambda caches: cls(layer, target, caches, num_steps, head)  # noqa: E731
        shape = VerifyShape(num_steps + 1)
        return ProposerBuild([spec], shape, build, snapshot_feature_dim=target.config.hidden_size)

    def copy_tokens(self, src: int, dst: int, n: int) -> None:
        self.cache.copy_slots(src, dst, n)

    def resume(self, row: int, features: torch.Tensor) -> None:
        self.last_hidden[row] = features

    def _uniform(
        self,
        prefix: torch.Tensor,
        rows: torch.Tensor,
        width: int,
        lengths: torch.Tensor | None = None,
        filler_row: int | None = None,
    ) -> ForwardBatch:
        kpool = self.layer.config.index_kpool
        table, cache, states = self.table, self.cache, self.states
        return ForwardBatch.uniform(prefix, rows, width, table, cache, states, kpool, lengths, filler_row)

    @torch.inference_mode()
    def observe(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """One MTP forward writes the entries of the forward's tokens: for tokens at positions
        `start .. start+n-1`, entries `start-1 .. start+n-2` (none for token 0; a padded chunk of
        token 0 alone writes a wrong one at 0, see `_observe_padded`)."""
        if commit.features is None:
            return
        if isinstance(batch.layout, Uniform):
            self._observe_uniform(batch, batch.layout.width, commit.features)
        elif isinstance(batch.layout, Padded):
            self._observe_padded(batch, batch.layout, commit.features)
        else:
            self._observe_chunks(batch, commit.features)
        self._keep_last_hidden(batch, commit)

    @torch.inference_mode()
    def observe_and_propose(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """For a uniform batch whose every sequence drafts, the observe's forward also computes draft
        step 0: its entry (last committed hidden, anchor) sits at position n-1, one past the forward's
        last committed entry, so the forward takes one more column and the anchor replaces the token
        after the committed ones (that entry and those after it are rewritten before they are read).
        One MTP forward fewer per verify step."""
        blocks, layout = len(batch.extend_lens), batch.layout
        if commit.features is None or not isinstance(layout, Uniform) or commit.sampling.shape[0] != blocks:
            super().observe_and_propose(batch, commit)
            return
        rows, width = batch.state_slots, layout.width
        verified = VerifiedBlocks(
            commit.features, batch.input_ids, batch.positions, batch.pad_index, commit.counts, commit.anchors
        )
        inputs = block_inputs(verified, self.last_hidden, rows, self.num_steps - 1, self.table.shape[1] - 1)
        embeds = self.layer.embedding(self.target)(inputs.tokens)
        hidden = self.layer(
            embeds, inputs.hidden.flatten(0, 1), self._uniform(inputs.prefix, rows, width + 1)
        )
        first = hidden.index_select(0, inputs.first)
        tokens = self.layer.greedy(first, self.target, self.head)
        self.drafts[rows, 0] = tokens
        self._chain(rows, inputs.chain, tokens, first, first_step=1)

    def _observe_uniform(self, batch: ForwardBatch, width: int, features: torch.Tensor) -> None:
        """The entries of a uniform batch's `width` tokens (every sequence past position 0), from
        device tensors alone (`features`: the target's of those tokens)."""
        blocks = len(batch.extend_lens)
        rows = batch.state_slots
        features = features.view(blocks, width, -1)
        hidden = torch.cat([self.last_hidden[rows][:, None], features[:, :-1]], 1)
        # a filler sequence starts at position 0 of the scratch row: its entries go there too
        prefix = (batch.positions[batch.pad_index[:, 0]] - 1).clamp(min=0)
        embeds = self.layer.embedding(self.target)(batch.input_ids)
        self.layer(embeds, hidden.flatten(0, 1), self._uniform(prefix, rows, width))

    def _observe_padded(self, batch: ForwardBatch, layout: Padded, features: torch.Tensor) -> None:
        """The entries of a padded chunk (a prefill graph's: n = `layout.lengths[0]` tokens from position
        S of table row `rows[0]`, then padding) from device tensors alone, in a padded MTP batch of the
        same width: the entry at S - 1 + j pairs the hidden of token S - 1 + j (for j = 0,
        `last_hidden[row]`) with token S + j. At S = 0 token 0 has no entry, so the MTP batch starts one
        token later, at position 0, with n - 1 entries; with n = 1 it still writes one, at position 0,
        from a padding token: an entry at n - 1 (= 0), which the invariant lets be wrong."""
        width = batch.input_ids.shape[0]
        rows = batch.state_slots
        start = batch.positions[batch.pad_index[:, 0]]
        at_zero = (start == 0).long()
        # MTP entry k takes target token k + at_zero and the hidden before it (`last_hidden` first)
        shift = torch.arange(width, device=start.device) + at_zero
        hidden = torch.cat([self.last_hidden[rows], features])[shift]
        tokens = batch.input_ids[shift.clamp(max=width - 1)]  # past the chunk: padding
        lengths = (layout.lengths - at_zero).clamp(min=1)
        embeds = self.layer.embedding(self.target)(tokens)
        self.layer(
            embeds, hidden, self._uniform(start - 1 + at_zero, rows, width, lengths, layout.filler_row)
        )

    def _keep_last_hidden(self, batch: ForwardBatch, commit: StepCommit) -> None:
        offsets = batch.pad_index[:, 0]
        self.last_hidden[batch.state_slots] = commit.features[offsets + commit.counts.long().clamp(min=1) - 1]

    def _observe_chunks(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        """The entries of a batch of chunks of any length (from its host lists): a chunk at position 0
        has no entry for its first token; every other token's hidden is the one before it (for the
        chunk's first token, the request's last committed hidden)."""
        chunks, token_index, hidden_index, kept = [], [], [], []
        offset = 0
        for start, n, row in zip(batch.prefix_lens, batch.extend_lens, batch.seq_rows, strict=True):
            first = int(start == 0)
            if n > first:
                chunks.append(SequenceChunk([0] * (n - first), start - 1 + first, row, row, sample=False))
                token_index += range(offset + first, offset + n)
                hidden_index += range(offset + first - 1, offset + n - 1)
                kept += [first == 0] + [False] * (n - 1 - first)
            offset += n
        if not chunks:
            return
        device = features.device
        token_index_d = to_device(token_index, device, torch.long)
        hidden_index_d = to_device(torch.tensor(hidden_index).clamp_(min=0), device)
        kept_d = to_device(kept, device, torch.bool)
        hidden = torch.where(
            kept_d[:, None], self.last_hidden[batch.token_rows[token_index_d]], features[hidden_index_d]
        )
        embeds = self.layer.embedding(self.target)(batch.input_ids[token_index_d])
        kpool = self.layer.config.index_kpool
        self.layer(embeds, hidden, ForwardBatch.build(chunks, self.table, self.cache, self.states, kpool))

    @torch.inference_mode()
    def propose(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """Step s (from 0) runs every sampling sequence at position n-1+s (n = its committed length):
        step 0 pairs the last committed hidden with the anchor, later steps the previous step's MTP
        hidden with its draft; draft s goes to column s of the request's draft row."""
        seqs = commit.sampling
        if seqs.numel() == 0:
            return
        rows = batch.state_slots[seqs]
        lengths = batch.positions[batch.pad_index[seqs, 0]] + commit.counts[seqs].long()
        steps = torch.arange(self.num_steps, device=lengths.device)
        positions = (lengths - 1 + steps[:, None]).clamp(max=self.table.shape[1] - 1)
        self._chain(rows, positions, commit.anchors[seqs], self.last_hidden[rows], first_step=0)

    def _chain(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        first_step: int,
    ) -> None:
        """Draft steps `first_step ..` from step `first_step`'s input token and hidden; `positions [S, B]`:
        row s the positions of step `first_step + s` (clamped to the table's end: drafts past it are
        never verified)."""
        embed = self.layer.embedding(self.target)
        for step in range(first_step, self.num_steps):
            hidden = self.layer(embed(tokens), hidden, self._uniform(positions[step - first_step], rows, 1))
            tokens = self.layer.greedy(hidden, self.target, self.head)
            self.drafts[rows, step] = tokens

"""Speculative verify steps as CUDA-graph replays: two graphs per batch-size bucket (a `GraphBank`).

Every sequence verifies its anchor and all drafts of `proposer.verify_shape` (T = its block). A step
uploads one small tensor (each block's prefix length, request-table row, anchor and whether it starts
after a commit in flight, from pinned memory). The verify graph builds the rest of the batch's
metadata from it and the request table on the device (positions, cache slots, completed pools, the
pool table), copies the drafts from the proposer's device rows into the static batch, and runs the
target's forward (with the proposer's features) and greedy acceptance into static `committed [B]` /
`anchors [B]` buffers. The commit graph commits what those buffers say: the KDA commit, the
proposer's observe and its drafts for the next step. A step whose every row is a raw-argmax greedy
row without logprobs replays both back to back; any other step (sampled, penalised, logit-biased,
logprob or `min_tokens`-banned rows) runs `verify.accept` on the verify graph's logits between the
two replays, exactly as an eager step would (same arguments, the noise of the same positions: the
static batch's), and overwrites the buffers' rows of its blocks. Filler sequences verify T tokens at
the start of the scratch slot's row and keep their greedy commit.

Steps it does not take (a prefill chunk, more sequences than the largest bucket) run eagerly; a
shorter block is padded to the width by the runner.

A block may start after the commit of a verify step still in flight on its row
(`SequenceChunk.after_commit`, the overlap schedule): the commit graph leaves each row's committed
positions and anchor in `CacheManager.last_committed` and `last_sampled`, and the next step's verify
graph adds the one to the uploaded prefix length and takes the other as the anchor (`IN_FLIGHT`), so
a verify step can be launched before the one ahead of it has been read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hylo.engine.cuda_graph import UniformBlocks, batch_size_buckets
from hylo.engine.graph_bank import GraphBank
from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from hylo.ops.acceptance import accepted_prefix
from hylo.speculative.proposer import Proposer, StepCommit
from hylo.speculative.verify import MAX_BLOCK_TOKENS, Acceptance, VerifyBatch, accept

# A bucket's two graphs, replayed in this order: the forward and greedy acceptance, then the commit.
VERIFY, COMMIT = "verify", "commit"


class VerifyGraphs:
    """Fixed-shape verify steps for the buckets up to `max_batch_size` (`bank`), captured as CUDA
    graphs when `capture` (into `pool` when given, shared with the decode graphs: they never replay at
    once). `proposer` drafts from device tensors alone.

    Invariant: the acceptance `run` returns stays valid until the next `run`."""

    kind, bucket_unit = "verify", "batch sizes"
    bodies = warm_bodies = (VERIFY, COMMIT)

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        caches: CacheManager,
        proposer: Proposer,
        max_batch_size: int,
        capture: bool,
        pool: tuple[int, int] | None = None,
    ):
        if proposer.needs_host:
            raise ValueError(
                "proposer: a verify graph needs a proposer that drafts from device tensors alone"
            )
        self.tokens_per_seq = proposer.verify_shape.block
        if self.tokens_per_seq > min(MAX_BLOCK_TOKENS, caches.plan.page_size):
            raise ValueError(
                f"proposer.verify_shape: verify graphs take blocks of 2 to "
                f"{min(MAX_BLOCK_TOKENS, caches.plan.page_size)} tokens, got {self.tokens_per_seq}"
            )
        self.layout = UniformBlocks(caches, self.tokens_per_seq, after_commit=True)
        self.model, self.caches, self.proposer = model, caches, proposer
        # each bucket's latest verify forward (run or captured): its features and KDA records are what
        # the commit body reads, and a replay rewrites the same tensors
        self.verified: dict[int, ForwardOutput] = {}
        device = caches.table.table.device
        buckets = batch_size_buckets(max_batch_size)
        # every block of a bucket samples: its rows 0..bucket-1, made once here, not an arange launch a commit
        self.sampling = {b: torch.arange(b, device=device) for b in buckets}
        self.bank = GraphBank(self, buckets, device, pool)
        if capture:
            self.bank.capture()

    @property
    def buckets(self) -> list[int]:
        return self.bank.buckets

    def accepts(self, seqs: Sequence[SequenceChunk]) -> bool:
        """Verify blocks of the graphs' width, as many as the largest bucket holds."""
        return len(seqs) <= self.buckets[-1] and all(
            len(s.token_ids) == self.tokens_per_seq and s.verify for s in seqs
        )

    def run(self, seqs: Sequence[SequenceChunk], blocks: VerifyBatch) -> Acceptance:
        """Verify and commit the blocks `seqs`, as `verify.accept` takes them (`blocks`: one row each,
        its real drafts, bans and grammar mask); the acceptance of the step's blocks, in order (with
        logprobs where asked)."""
        if not self.accepts(seqs) or len(blocks.rows) != len(seqs):
            raise ValueError(
                f"seqs: a verify graph takes up to {self.buckets[-1]} verify blocks of "
                f"{self.tokens_per_seq} tokens, with one verify batch row each"
            )
        n, width = len(seqs), self.tokens_per_seq
        bucket = self.bank.bucket_for(n)
        self.bank.upload(bucket, seqs)
        logits, target, committed, anchors = self.bank.replay(bucket, VERIFY)
        if blocks.picks_argmax and blocks.max_logprobs is None:
            result = Acceptance(committed[:n] - 1, target[:n], committed[:n], anchors[:n])
        else:
            static = self.bank.static[bucket]
            drafts = static.input_ids.view(bucket, width)[:n, 1:]
            picked_at = static.positions.view(bucket, width)[:n] + 1  # each pick follows its token
            result = accept(logits.view(bucket, width, -1)[:n], drafts, blocks, picked_at)
            committed[:n] = result.committed
            anchors[:n] = result.anchors
        self.bank.replay(bucket, COMMIT)
        return result

    def body(self, name: str, bucket: int) -> tuple[torch.Tensor, ...]:
        """The verify graph's outputs (`_greedy` over `_forward`), or the commit of the bucket's latest
        verify run's `committed` and `anchors` (none)."""
        static = self.bank.static[bucket]
        if name == COMMIT:
            _, _, committed, anchors = self.bank.outputs[VERIFY, bucket]
            self._commit(static, self.verified[bucket], committed, anchors)
            return ()
        self.verified[bucket] = self._forward(static, self.bank.step_inputs[bucket])
        return self._greedy(static, self.verified[bucket].logits)

    def _forward(self, static: ForwardBatch, inputs: torch.Tensor) -> ForwardOutput:
        """The target's forward of the static batch, its metadata filled from the uploaded `inputs`
        and its drafts taken from the proposer's rows."""
        blocks, width = len(static.extend_lens), self.tokens_per_seq
        self.layout.fill_metadata(static, inputs)
        ids = static.input_ids.view(blocks, width)
        ids[:, 1:] = self.proposer.drafts[static.state_slots]
        return self.model(static, self.proposer.capture_layers)

    def _greedy(self, static: ForwardBatch, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`(logits [B·T, vocab], greedy picks [B, T], committed [B], anchors [B])` of the verify
        forward's `logits`."""
        blocks, width = len(static.extend_lens), self.tokens_per_seq
        ids = static.input_ids.view(blocks, width)
        target = logits.argmax(-1).view(blocks, width)
        _, committed, anchors = accepted_prefix(target, ids[:, 1:])
        return logits, target, committed, anchors

    def _commit(
        self, static: ForwardBatch, verified: ForwardOutput, committed: torch.Tensor, anchors: torch.Tensor
    ) -> None:
        """The KDA commit (of what the `verified` forward kept) and the proposer's observe and drafts,
        from the buffers, and each row's committed positions and anchor for a block launched behind
        this step."""
        self.model.commit(static, verified.kda_records, committed)
        self.caches.last_committed[static.state_slots] = committed
        self.caches.last_sampled[static.state_slots] = anchors
        sampling = self.sampling[len(static.extend_lens)]
        self.proposer.observe_and_propose(static, StepCommit(committed, anchors, sampling, verified.features))

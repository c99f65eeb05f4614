"""KDA (Kimi Delta Attention) layer: the linear-attention layers of GLM-5.3-Flash."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.forward_batch import ForwardBatch
from hylo.kda_plan import Offsets
from hylo.layers.linear import FusedLinear, Linear
from hylo.ops import kda as kda_ops
from hylo.parallel.layout import SINGLE, Parallel


class KDAAttention(nn.Module):
    """q|k|v projections, one depthwise causal conv over the three, safe-gated delta rule, gated norm.
    The projections of the layer input run as one GEMM (`in_proj`; two in an FP8 checkpoint, whose
    b_proj is stored unquantised, except in a decode step, which multiplies b's rows itself).

    `conv_weight [3·H·d, K]` is the checkpoint's q_conv1d, k_conv1d and v_conv1d stacked in that order.
    Under tensor parallelism H is this rank's heads: every per-head tensor (q/k/v, f_b, g_b, b, dt_bias,
    A_log, the conv channels, the state slots) is split by head, f_a and g_a are replicated, and
    o_proj is row parallel: `forward` returns this rank's partial sum, which the decoder layer completes.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, parallel: Parallel = SINGLE):
        super().__init__()
        d, hidden = config.linear_head_dim, config.hidden_size
        h = parallel.part(config.linear_num_heads, "linear_num_heads")
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, h, d
        self.lower_bound, self.eps = config.linear_lower_bound, config.rms_norm_eps
        # q, k, v, f_a, g_a and b read the same input: one GEMM. Under tensor parallelism each part is
        # this rank's share of its checkpoint tensor (q, k, v and b split by head, f_a and g_a whole);
        # f_a and g_a come before b so that their columns start 16-byte aligned whatever H is
        parts = (("q_proj", h * d), ("k_proj", h * d), ("v_proj", h * d), ("f_a_proj", d), ("g_a_proj", d))
        self.in_proj = FusedLinear(hidden, (*parts, ("b_proj", h)))
        self.conv_weight = nn.Parameter(
            torch.empty(3 * h * d, config.linear_conv_kernel_dim, dtype=torch.float32)
        )
        self.f_b_proj = Linear(d, h * d)
        self.dt_bias = nn.Parameter(torch.empty(h * d, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.g_b_proj = Linear(d, h * d)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.o_proj = Linear(h * d, hidden)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, kda_ops.VerifyCache | None]:
        """Packed tokens in, packed out, walking the batch as its plan says (`batch.kda`). Sequences
        advance their slots' conv windows and states in place (a step of single tokens by the decode
        kernels, anything else by the varlen chunked prefill), except verify chunks: they run as one
        block per sequence from the committed state, which stays untouched, and the second value is
        what `commit` needs to advance it afterwards (None without verify chunks)."""
        tokens, heads = x.shape[0], (self.num_heads, self.head_dim)
        plan, record = batch.kda, None
        if not batch.verify_seqs and not batch.snapshot_points and _single_tokens(plan.offsets()):
            return self._decode(x, batch), None
        q, k, v, f_a, g_a, b = self.in_proj(x)
        qkvfb = kda_ops.KDAInputs(q, k, v, self.f_b_proj(f_a), b)
        norm = kda_ops.OutputNorm(self.g_b_proj(g_a).unflatten(-1, heads), self.o_norm.weight, self.eps)
        if not batch.verify_seqs and batch.snapshot_points:
            o = self._advance_taking_snapshots(qkvfb, batch)
        elif not batch.verify_seqs:
            o = self._advance(qkvfb, batch.state_slots, plan.offsets(), batch, plan.padded_chunk_ids)
        else:
            verify = plan.verify()
            slots = self._slots(batch, verify.block_slots)
            if verify.whole_batch:  # a verify graph's batch: no gather in, no scatter out
                blocks = qkvfb.blocks(verify.block_tokens.shape[1])
                o_blocks, record = kda_ops.verify(blocks, self.params, slots)
                o = o_blocks.flatten(0, 1)
                return self._finish(o, norm, tokens), record
            o = x.new_empty(tokens, *heads)
            blocks = qkvfb.rows(verify.block_tokens)  # [sequences, T, ...], short blocks padded
            o_blocks, record = kda_ops.verify(blocks, self.params, slots)
            o[verify.verified_tokens] = o_blocks.flatten(0, 1)[verify.verified_positions]
            if batch.snapshot_points:  # prefill chunks beside the blocks leave prefix snapshots
                verifying = set(batch.verify_seqs)
                others = [i for i in range(len(batch.extend_lens)) if i not in verifying]
                self._advance_in_segments(qkvfb, others, batch, o)
            elif verify.other_slots.numel():
                rest = qkvfb.rows(verify.other_tokens)
                o[verify.other_tokens] = self._advance(rest, verify.other_slots, verify.other_offsets, batch)
        return self._finish(o, norm, tokens), record

    def _decode(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """A decode step: f_b and g_b are multiplied inside the step and the output norm, which runs with
        the step (two launches in all on CUDA), and so is b where it is `in_proj`'s dense part (an FP8
        checkpoint's b_proj, one row a head: not whole [128, 128] blocks), whose GEMM is then not run."""
        b_rows = self._b_rows_apart()
        q, k, v, f_a, g_a, b = self.in_proj(x, dense=b_rows is None)
        if b_rows is not None:
            b = kda_ops.LowRank(x, b_rows)
        f, gate = _low_rank(f_a, self.f_b_proj), _low_rank(g_a, self.g_b_proj)
        step = kda_ops.KDAInputs(q, k, v, f, b)
        norm = kda_ops.OutputNorm(gate, self.o_norm.weight, self.eps)
        o = kda_ops.decode(step, self.params, self._slots(batch, batch.state_slots), norm)
        return self.o_proj(o.reshape(x.shape[0], -1))

    def _b_rows_apart(self) -> torch.Tensor | None:
        """`in_proj.dense_weight` when it holds b_proj's rows alone (the other parts in the e4m3 GEMM),
        else None (b in the one GEMM, or beside another part that needs the dense GEMM anyway)."""
        param, lo, hi = self.in_proj.rows()["b_proj"]
        dense = self.in_proj.dense_weight
        return dense if param == "dense_weight" and hi - lo == dense.shape[0] else None

    def _finish(self, o: torch.Tensor, norm: kda_ops.OutputNorm, tokens: int) -> torch.Tensor:
        """The gated output norm and the output projection of the heads' outputs `o [T, H, d]`."""
        o = kda_ops.gated_norm(o, norm)
        return self.o_proj(o.reshape(tokens, -1))

    def commit(self, batch: ForwardBatch, record: kda_ops.VerifyCache, n_accepted: torch.Tensor) -> None:
        """Advance each verify chunk's window and state by its first `n_accepted[j]` tokens (int32,
        device), from what this layer's verify forward of `batch` recorded (`record`)."""
        slots = self._slots(batch, batch.kda.verify().block_slots)
        kda_ops.commit(record, self.params, slots, n_accepted)

    @property
    def params(self) -> kda_ops.KDAParams:
        return kda_ops.KDAParams(self.conv_weight, self.dt_bias, self.A_log, self.lower_bound)

    def _slots(self, batch: ForwardBatch, slots: torch.Tensor) -> kda_ops.KDASlots:
        layer = batch.states.kda_index[self.layer_idx]
        return kda_ops.KDASlots(batch.states.conv[layer], batch.states.recurrent[layer], slots)

    def _advance_taking_snapshots(self, qkvfb: kda_ops.KDAInputs, batch: ForwardBatch) -> torch.Tensor:
        """Advance every sequence of a prefill batch that leaves prefix-cache snapshots: in one call
        whose chunk kernels take those inside the sequences (`KDAPlan.chunk_snapshots`), the windows and
        states of those at a sequence's end copied from its slot after it; in segments where a snapshot
        falls off the KDA chunks' boundaries."""
        plan = batch.kda.chunk_snapshots(self.lower_bound)
        if plan is None:
            o = qkvfb.q.new_empty(qkvfb.q.shape[0], self.num_heads, self.head_dim)
            self._advance_in_segments(qkvfb, range(len(batch.extend_lens)), batch, o)
            return o
        o = self._advance(qkvfb, batch.state_slots, batch.kda.offsets(), batch, plan.chunk_ids)
        if plan.end_ids.numel():
            layer, pool = batch.states.kda_index[self.layer_idx], batch.snapshot_pool
            pool.conv[layer, plan.end_ids] = batch.states.conv[layer, plan.end_slots]
            pool.recurrent[layer, plan.end_ids] = batch.states.recurrent[layer, plan.end_slots]
        return o

    def _advance_in_segments(self, qkvfb, seqs, batch: ForwardBatch, o: torch.Tensor) -> None:
        """Advance sequences `seqs` (batch indices) segment by segment, their chunks split at their
        snapshot points (`KDAPlan.segment_rounds`): round r advances every sequence's r-th segment in
        one call, then copies the windows and states of the sequences whose segment ended at a point
        into those snapshots. Outputs go to `o` at the sequences' packed tokens."""
        layer = batch.states.kda_index[self.layer_idx]
        for r in batch.kda.segment_rounds(tuple(seqs)):
            o[r.tokens] = self._advance(qkvfb.rows(r.tokens), r.slots, r.offsets, batch)
            if r.snapshot_ids.numel():
                pool = batch.snapshot_pool
                pool.conv[layer, r.snapshot_ids] = batch.states.conv[layer, r.snapshot_slots]
                pool.recurrent[layer, r.snapshot_ids] = batch.states.recurrent[layer, r.snapshot_slots]

    def _advance(
        self,
        qkvfb: kda_ops.KDAInputs,
        slots: torch.Tensor,
        offsets: Offsets,
        batch: ForwardBatch,
        chunk_snapshots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Advance the sequences at `offsets` in state `slots`; `chunk_snapshots`: the snapshot id after
        each KDA chunk of the call (`ChunkSnapshots`, into `batch.snapshot_pool`), None: none."""
        cu_cpu, cu = offsets
        if _single_tokens(offsets):
            return kda_ops.decode(qkvfb, self.params, self._slots(batch, slots))
        snapshots = None
        if chunk_snapshots is not None:
            layer, pool = batch.states.kda_index[self.layer_idx], batch.snapshot_pool
            snapshots = kda_ops.ChunkSnapshots(chunk_snapshots, pool.conv[layer], pool.recurrent[layer])
        return kda_ops.prefill(qkvfb, self.params, self._slots(batch, slots), cu, cu_cpu, snapshots)


def _low_rank(a: torch.Tensor, projection: Linear) -> kda_ops.LowRank:
    """`projection(a)` as factors, for a kernel that multiplies them as it reads them."""
    return kda_ops.LowRank(a, projection.weight, projection.weight_scale_inv)


def _single_tokens(offsets: Offsets) -> bool:
    """Whether the sequences at `offsets` have one token each, as the host offsets say (none: unknown)."""
    cu_cpu = offsets[0]
    return cu_cpu is not None and cu_cpu[-1] == len(cu_cpu) - 1

"""The TP/EP plan of the full GLM-5.3-Flash text model (45 layers, 288 experts, FP8 routed experts) on
H200s, computed on the CPU from meta-device shapes (`sizing.py`): the memory each rank
holds at TP4 and TP8 (experts split by expert and by tensor), and the device collectives of one step
with the time they imply over NVLink. Prints markdown.

    PYTHONPATH=src .venv/bin/python benchmarks/tp_plan.py
"""

from __future__ import annotations

import sizing

GiB, MiB = 2**30, 2**20
SLOTS = 64  # request slots set aside in the token-capacity column
DECODE_BATCHES = (1, 8)
PREFILL = 13312
DFLASH_BLOCK = 8


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def memory_table(config) -> list[str]:
    lines = [
        f"Per rank, GiB (2^30 bytes). GPU: {gib(sizing.GPU_BYTES)} GiB; allowance "
        f"{gib(sizing.ALLOWANCE_BYTES)} GiB; engine budget = {sizing.MEM_FRACTION_STATIC} × GPU − weights − "
        f"{gib(sizing.CUDA_CONTEXT_BYTES)} GiB CUDA context (what `mem_fraction_static`'s default plans).",
        "",
        "| TP | EP | ranks equal | routed experts (FP8) | other weights | MTP layer (its FP8 experts) | "
        "weights / rank | left after weights | left after allowance | engine budget @0.85 | "
        "KDA state / slot | token caches / token (target + MTP) | tokens with 64 slots (MTP on) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tp, ep in ((1, 1), (4, 4), (4, 1), (8, 8), (8, 1)):
        m = sizing.rank_memory(config, tp, ep)
        w = m.weights
        fits = m.left_for_caches > 0
        cells = [
            tp, ep, "yes" if m.ranks_equal else "NO", gib(w.routed_experts), gib(w.other),
            f"{gib(w.mtp)} ({gib(w.mtp_routed_experts)})", f"**{gib(w.total)}**", gib(m.left_after_weights),
            f"**{gib(m.left_for_caches)}**", gib(m.engine_budget), f"{m.kda_state_per_slot / MiB:.2f} MiB",
            f"{m.tokens_per_token:.0f} + {m.mtp_tokens_per_token:.0f} B",
            f"{m.tokens_with_slots(SLOTS) / 1e6:.2f} M" if fits else "does not fit",
        ]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def _us(x: float) -> str:
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def _bytes(n: float) -> str:
    return f"{n:.0f} B" if n < 1e3 else f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:,.2f} MB"


def comm_rows(config, tp: int) -> list[tuple[str, int, int, list[sizing.Collective]]]:
    rows = []
    for b in DECODE_BATCHES:
        rows.append((f"target decode, B={b}", b, b, sizing.target_step(config, tp, b, b)))
    for b in DECODE_BATCHES:
        t = b * DFLASH_BLOCK
        rows.append(
            (f"target verify, B={b} × {DFLASH_BLOCK} tokens", t, t, sizing.target_step(config, tp, t, t))
        )
    rows.append((f"target prefill, {PREFILL} tokens", PREFILL, 1, sizing.target_step(config, tp, PREFILL, 1)))
    for b in DECODE_BATCHES:
        rows.append((f"MTP: one chained draft step, B={b}", b, b, sizing.mtp_draft_step(config, tp, b)))
    rows.append((f"MTP: observe of the {PREFILL}-token prefill", PREFILL - 1, 0,
                 sizing.mtp_observe(config, PREFILL - 1)))  # fmt: skip
    for b in DECODE_BATCHES:
        rows.append((f"DFlash draft (block {DFLASH_BLOCK}), B={b}", b * DFLASH_BLOCK, b * (DFLASH_BLOCK - 1),
                     sizing.dflash_draft(config, tp, b, DFLASH_BLOCK)))  # fmt: skip
    return rows


def comm_table(config) -> list[str]:
    lines = [
        f"Per rank and step. Bandwidth term: ring bytes sent per rank / {sizing.RING_BUSBW / 1e9:.0f} GB/s "
        "bus bandwidth. Latency term: Σ collectives × NCCL's ring latency model (LL protocol up to "
        f"{sizing.LL_MAX_BYTES // MiB} MiB, Simple above; the device-side floor a CUDA-graph replay sees), "
        f"and × {sizing.EAGER_COLLECTIVE_US:.0f} us per collective of at most "
        f"{sizing.EAGER_MAX_BYTES // MiB} MiB (measured eager 8×H100 all-reduce; larger ones keep the "
        "model's figure). A prefill longer than `chunked_prefill_size` (8192) runs as several forwards: "
        "the same bytes, that many times the latency.",
        "",
        "| TP | step | tokens | rows sampled | all-reduces × message | all-gathers (gathered output) | "
        "sent / rank | bandwidth term (us) | latency term, NCCL model (us) | latency term, eager (us) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tp in (4, 8):
        for name, tokens, rows, collectives in comm_rows(config, tp):
            s = sizing.step_comm(collectives, tp)
            ars = [c for c in collectives if c.kind == sizing.ALL_REDUCE]
            ags = [c for c in collectives if c.kind == sizing.ALL_GATHER]
            ar = " + ".join(f"{c.count} × {_bytes(c.message_bytes)}" for c in ars)
            ag = " + ".join(_bytes(c.message_bytes) for c in ags) or "—"
            lines.append(
                f"| {tp} | {name} | {tokens} | {rows} | {ar} | {ag} | {_bytes(s.sent_per_rank)} | "
                f"{_us(s.bandwidth_us)} | **{_us(s.latency_us)}** | {_us(s.eager_latency_us)} |"
            )
    return lines


def main() -> None:
    config = sizing.full_config()
    c = config
    print(
        f"## TP/EP plan: {c.num_hidden_layers} layers, {c.n_routed_experts} experts, hidden {c.hidden_size}, "
        f"vocab {c.vocab_size}; routed experts FP8, the rest bf16\n"
    )
    print("### Memory per rank\n")
    print("\n".join(memory_table(config)))
    print("\nAllowance: " + "; ".join(f"{k} {gib(v)} GiB" for k, v in sizing.ALLOWANCE_PARTS.items()) + ".")
    print("\n### Device collectives per step\n")
    print("\n".join(comm_table(config)))
    print(
        f"\nSources: bus bandwidth {sizing.BUSBW_SOURCE}; latency model {sizing.LATENCY_SOURCE}; "
        f"eager latency {sizing.EAGER_SOURCE}."
    )


if __name__ == "__main__":
    main()

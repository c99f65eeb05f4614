#!/usr/bin/env bash
# Train drafts for the shipped demo target on the lent GPU. The target's greedy answers are generated
# once (hylo's engine, through `hylo.train.draft.distill`) and shared; then every draft named below
# trains side by side with `hylo train-draft`. Everything comes back as one file, $OUT/drafts.tgz (a
# call returns at most 8 files): each draft's model/, training.json, loss log and console log.
#
#   benchmarks/device/train_demo_drafts.sh PROMPTS.jsonl NUM_PROMPTS SECONDS NAME:ALGORITHM:STEPS:OPTIONS...
#
# PROMPTS.jsonl: `{"messages": [...]}` conversations (the ShareGPT package is too large to carry), as
# `benchmarks/demo_draft_prompts.py --out PROMPTS.jsonl --count NUM_PROMPTS` writes them on the CPU machine.
# SECONDS: when everything must be done, counted from the start (a draft still training then is
# killed). STEPS: each draft's schedule, fixed: a time budget's fit from the first steps would run
# while the other drafts still capture features and come out ~3x short (session 20); two drafts side
# by side took ~7 steps/s each on the H200. OPTIONS: extra `train-draft` flags, '+' for ' '.
# ANSWERS=path/answers.npz (an earlier run's, same prompts) skips the generation. Carry `.whl/` with the
# wheels the device README names (transformers==5.23.0, pydantic and its needs, tokenizers; the MTP
# layer trains through transformers) and the prompts' folder. Example (session 20):
#   benchmarks/device/train_demo_drafts.sh prompts.jsonl 20000 540 \
#     dflash:dflash:1800:--num-layers+2+--intermediate-size+512+--target-layers+1,3,5+--lr+1.5e-3 ...
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:src || exit 1
export PYTHONUNBUFFERED=1
PROMPTS=$1 NUM=$2 DEADLINE=$((SECONDS + $3)); shift 3
TARGET=src/hylo/assets/glm5-next-demo D=/tmp/drafts MAX_TOKENS=128
mkdir -p "$D/answers"
[ -n "$ANSWERS" ] && cp "$ANSWERS" "$D/answers/answers.npz"  # answers.npz of an earlier run
python3 - "$TARGET" "$PROMPTS" "$NUM" "$D/answers" "$MAX_TOKENS" "${DEVICE:-cuda}" <<'EOF' 2>&1 | grep -v Warning | tee "$D/answers.log" || exit 1
import sys, time
from pathlib import Path
import numpy as np
import torch
from hylo.tokenizer import Tokenizer
from hylo.train.data import id_dtype
from hylo.train.draft import distill, training_prompts, write_distill_cache
target, prompts_file, count, out, max_tokens, device = sys.argv[1:]
started = time.perf_counter()
prompts = training_prompts(Tokenizer.from_dir(target), prompts_file, int(count), 256)
if Path(out, "answers.npz").is_file():  # an earlier run's answers: no generation
    saved = np.load(Path(out, "answers.npz"))
    answers = [a.tolist() for a in np.split(saved["tokens"], np.cumsum(saved["lengths"])[:-1])]
    assert len(answers) == len(prompts), "the answers are for other prompts"
    write_distill_cache(Path(out), prompts, int(max_tokens), answers)
else:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    answers = distill(Path(target), Path(out), prompts, int(max_tokens), device, dtype)
tokens = sum(map(len, answers))
print(f"answers: {len(answers)} prompts, {tokens} tokens in {time.perf_counter() - started:.1f} s")
# the answers compact (the cache holds Python lists), to seed a later run's distill.pt
flat = np.concatenate([np.asarray(a, np.int64) for a in answers])
np.savez_compressed(
    Path(out) / "answers.npz", tokens=flat.astype(id_dtype(int(flat.max(initial=0)))),
    lengths=np.array([len(a) for a in answers], np.int32),
)
EOF
for spec in "$@"; do
  IFS=: read -r name algorithm steps options <<<"$spec"
  mkdir -p "$D/$name" && cp "$D/answers/distill.pt" "$D/$name/"
  # shellcheck disable=SC2086
  (timeout $((DEADLINE - SECONDS)) python3 -m hylo.cli train-draft --target $TARGET --algorithm "$algorithm" \
     --out "$D/$name" --data "$PROMPTS" --num-prompts "$NUM" --max-tokens $MAX_TOKENS \
     --steps "$steps" --warmup 50 --checkpoint-every 100000 --no-progress ${options//+/ } \
     >"$D/$name.log" 2>&1; echo "exit $?" >>"$D/$name.log") &
done
wait
for spec in "$@"; do name=${spec%%:*}; echo "== $name"; tail -3 "$D/$name.log"; done
tar czf "$OUT/drafts.tgz" -C "$D" --exclude=distill.pt --exclude=checkpoint.pt --exclude='*.partial' .

#!/usr/bin/env bash
# Train the demo drafts (DFlash, DFlash2, MTP) for the shipped demo target on the lent GPU; results to $OUT.
set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src || exit 1; rm -rf /tmp/site/fla /tmp/site/fla_core*; export PYTHONUNBUFFERED=1
T=src/hylo/assets/glm5-next-demo; D=/tmp/dd; mkdir -p $D
for a in dflash dflash2 mtp; do
  mkdir -p $D/$a; [ -f $D/dflash/distill.pt ] && cp $D/dflash/distill.pt $D/$a/ 2>/dev/null
  extra=""; [ $a != mtp ] && extra="--num-layers 2 --intermediate-size 512"
  date; timeout 200 python3 -m hylo.cli train-draft --target $T --algorithm $a --out $D/$a --num-prompts 3000 --max-tokens 128 --time-budget 105 --steps 20000 --warmup 50 --batch-size 32 --no-progress $extra 2>&1 | grep -v "Generating\|Warning\|warn(" | tail -15
done 2>&1 | tee $OUT/train.log
cp $D/dflash/model/model.safetensors $OUT/dflash_model.safetensors; cp $D/dflash/model/config.json $OUT/dflash_config.json
cp $D/dflash2/model/model.safetensors $OUT/dflash2_model.safetensors; cp $D/dflash2/model/config.json $OUT/dflash2_config.json
cp $D/mtp/model/mtp.safetensors $OUT/mtp.safetensors
for a in dflash dflash2 mtp; do echo "== $a"; cat $D/$a/training.json; done > $OUT/reports.txt
for a in dflash dflash2 mtp; do sed "s/^/$a /" $D/$a/run/loss.jsonl; done > $OUT/losses.txt

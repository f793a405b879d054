# Shared fixtures of lab/scripts/audit_bad_inputs.py, made once in $FIX (the working folder):
#   runs/smoke/   a finished run of configs/smoke.yaml (checkpoints, model/, metrics.json)
#   model/        that run's save_pretrained export (a 2-layer, width-32 LongNetLM)
#   notes.txt     a short text file
# Cases copy what they change: cp -r "$FIX/runs" . ; cp -r "$FIX/model" .
set -euo pipefail
longnet fit --config "$REPO/configs/smoke.yaml" \
    --trainer.logger.init_args.save_dir runs --trainer.logger.init_args.name smoke > fit.log 2>&1
cp -r runs/smoke/model model
printf 'def main():\n    print("hello")\n' > notes.txt

# Sourced by the H200 device scripts after they set OUT and RES: a timestamped log, a packer
# that copies everything under $RES back through $OUT after each stage (so a call cut short
# still returns what it finished), and env.txt naming the GPU, clocks, torch/triton, date and
# commit that every committed figure cites.
mkdir -p "$OUT" "$RES"
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$RES/run.log"; }
pack() { tar -C /tmp -cf "$OUT/results.tar" res; cp "$RES/run.log" "$OUT/run.log"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%dT%H:%M:%SZ; cat COMMIT 2>/dev/null || echo "commit unknown"
  } > "$RES/env.txt" 2>&1
cat "$RES/env.txt"

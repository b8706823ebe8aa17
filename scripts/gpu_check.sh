#!/usr/bin/env bash
# The prepared GPU check: run it first thing in any session that is lent a GPU, and put its table in the docs.
#
#   scripts/gpu_check.sh run          # on the GPU machine, through the device tool: `bash scripts/gpu_check.sh run`
#   scripts/gpu_check.sh smoke        # on a CPU, the same commands at toy sizes (CI runs it without the packages the
#                                     # GPU image lacks, tests/helpers/device_image, so the check cannot rot), and
#                                     # the Triton kernels compiled for Hopper (sm_90) in the run's shapes
#   scripts/gpu_check.sh summary DIR  # the table again from a run's $OUT (one cut short by the call's limit too)
#
# `run` needs nothing carried: the GPU image's torch, triton, transformers and lightning serve the kernels' benchmarks
# and the model step (the 8-rank SmolLM2 emulation needs wheels and the GGUF file: scripts/gpu_emulation.sh, two more
# calls). After a short run that compiles the kernels, its parts, most wanted first, each capped so that all fit one
# 10-minute call: block-sparse attention forward and backward in Qwen2.5-0.5B's attention shape (14 query and 2 KV
# heads, head dim 64, block 64, bf16) at 8K and 32K tokens against cuDNN's and FlexAttention's dense attention, at
# densities 0.1, 0.25, 0.5 and 1.0, with the selection's share of the dense forward and the kernels, host
# synchronisations and host time of one layer; a whole-model step of Qwen2.5-0.5B's dimensions at 32K tokens, dense
# against sparse at density 0.25; the CUDA tests; the attention at 128K tokens. It ends with one table of the figures
# against their targets. Each part's log and JSON land in $OUT, the JSON as it measures, so that a part cut short by its cap keeps what it measured (the device tool brings them back).
set -uo pipefail
# run from the repository root; the benchmarks import the package from this checkout, installed or not
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mode=${1:-}
OUT=${OUT:-outputs/gpu_check}
started=$SECONDS
stamp() { echo "== $1 at $((SECONDS - started)) s"; }

summary() {
  python3 - "$1" <<'PY'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []


def row(check, figure, target=""):
    rows.append(f"| {check} | {figure} | {target} |")


tests = out / "cuda_tests.log"
lines = tests.read_text().strip().splitlines() if tests.exists() else []
row("CUDA tests", lines[-1] if lines else "not run")
attention = {int(re.search(r"_(\d+)\.json", p.name).group(1)): json.loads(p.read_text())
             for p in out.glob("attention_*.json")}
for tokens, fig in sorted(attention.items()):
    for variant, why in fig.get("failed", {}).items():
        row(f"{tokens}: {variant}", f"failed: {why}")
    if "dense_ms" not in fig:  # dense attention or the selection failed: nothing to compare with
        continue
    dense = fig["dense_ms"]
    base = dense.get("cudnn", dense["dense"])
    row(f"{tokens} tokens: dense fwd+bwd, ms", ", ".join(f"{k} {v:.2f}" for k, v in dense.items()))
    for entry in fig["sparse"]:
        row(f"{tokens}: {entry['backend']} sparse at density {entry['density']:g}, ms (of dense)",
            f"{entry['ms']:.2f} ({entry['ms'] / base:.3f})")
    full = [e["ms"] for e in fig["sparse"] if e["density"] == 1.0]
    if full:
        row(f"{tokens}: best sparse backend at density 1 / {'cuDNN' if 'cudnn' in dense else 'dense'}",
            f"{min(full) / base:.3f}", "<= 1.25")
    fastest = {}  # (mask, density) -> the backends timed there, fastest first
    for entry in sorted(fig["sparse"], key=lambda e: e["ms"]):
        fastest.setdefault((entry["mask"], entry["density"]), []).append(entry["backend"])
    wins = [names[0] for names in fastest.values() if len(names) > 1]
    if wins:
        row(f"{tokens}: fastest sparse backend, masks and densities won", ", ".join(
            f"{name} {wins.count(name)}/{len(wins)}" for name in sorted(set(wins))), "decides the GPU default")
    row(f"{tokens}: selection / dense forward", f"{fig['selection_ms'] / fig['dense_forward_ms']:.3f} "
        f"({fig['selection_ms']:.2f} ms)", "<= 0.10")
    low = [e for e in fig["sparse"] if e["density"] == 0.1]
    if low:
        best = min(low, key=lambda e: e["ms"])
        row(f"{tokens}: selection + attention at density 0.1 ({best['backend']}), ms",
            f"{fig['selection_ms'] + best['ms']:.2f}", "<= 0.5 on an H200" if tokens == 8192 else "")
    if "launches_per_micro_batch" in fig:
        row(f"{tokens}: kernels once per micro-batch (documents the layers share)", fig["launches_per_micro_batch"])
    for variant, count in fig.get("launches", {}).items():
        row(f"{tokens}: kernels and host syncs per layer ({variant})", f"{count['kernels']}, {count['host_syncs']}",
            "<= 40, 0")
        if count.get("host_ms") is not None:  # the host's part of the fixed cost per layer
            row(f"{tokens}: host time per layer ({variant}), ms", f"{count['host_ms']:.3f}",
                "a share of the fixed cost (<= 0.5 on an H200)" if tokens == 8192 else "")
        if count.get("busiest"):  # where the layer's GPU time goes
            kernels = ", ".join(f"{k['name']} {k['ms']:.3f} ({k['calls']}x)" for k in count["busiest"][:3])
            row(f"{tokens}: kernel time per layer ({variant}), ms, and its busiest kernels",
                f"{count['kernel_ms']:.3f}: {kernels}")
for path in sorted(out.glob("compiled_sm*.json")):
    fig = json.loads(path.read_text())
    for need in fig["kernels"]:
        row(f"sm_{fig['arch']}, {fig['dtype']}, head dim {fig['head_dim']}, compiled without the GPU: "
            f"{need['kernel']}", f"{need['registers']} registers, {need['stack_bytes']} B spilled, "
            f"{need['shared_bytes'] / 1024:.1f} KiB shared, {need['stages']} stages",
            f"0 B spilled, <= {fig['shared_limit_kib']} KiB shared")
step = out / "model_step.json"
if step.exists():
    fig = json.loads(step.read_text())
    for name, v in fig.get("variants", {}).items():
        row(f"model step {fig['lengths']}: {name}, ms (of dense)", f"{v['ms']:.1f} ({v['of_dense']:.3f}, "
            f"density {v['density']:.3f})", "<= 0.55 at density 0.25" if "0.25" in name else "")
        if "attention_ms" in v:  # what sparsity can shorten, and what it cannot
            row(f"model step {fig['lengths']}: {name}, attention ms (share of the step)",
                f"{v['attention_ms']:.1f} ({v['attention_share']:.3f})")
    for name, why in fig.get("failed", {}).items():
        row(f"model step {fig['lengths']}: {name}", f"failed: {why}")
print("| check | figure | target |\n| --- | --- | --- |")
print("\n".join(rows))
PY
}

gpu_heads=(--q-heads 14 --kv-heads 2 --head-dim 64 --block-size 64 --stride 16)  # Qwen2.5-0.5B's attention
case "$mode" in
run)
  device=cuda dtype=bf16 heads=("${gpu_heads[@]}")
  warm=2048 lengths=(8192 32768 131072) reps=(5 5 3) model=(--preset qwen2.5-0.5b --lengths 32768 --reps 3)
  tests=(--maxfail=10)
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, lightning
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__,
      'lightning', lightning.__version__)"
  ;;
smoke)
  device=cpu dtype=fp32 heads=(--q-heads 2 --kv-heads 1 --head-dim 16 --block-size 16 --stride 8)
  warm=128 lengths=(256 512 1024) reps=(1 1 1) model=(--preset demo --lengths 512 --reps 1)
  # FlexAttention has no backward on the CPU: the model step reports its variant failed, and times the others
  tests=(--co)  # collected only: they need CUDA
  mkdir -p "$OUT"
  # the run's shapes on Hopper; and heads of 128 (Qwen3's) on sm_86 (A10, RTX 3090), whose 99 KiB of shared memory
  # per program hold fewer pipeline stages
  for target in "90 64" "86 128"; do
    read -r arch head_dim <<<"$target"
    stamp "compiling the Triton kernels for sm_$arch at head dim $head_dim"
    env -u TRITON_INTERPRET timeout 120 python3 benchmarks/attention.py --compile-for "$arch" --dtype bf16 \
      "${gpu_heads[@]}" --head-dim "$head_dim" --json "$OUT/compiled_sm$arch.json" 2>&1 \
      | tee "$OUT/compiled_sm$arch.log" | tail -8
  done
  ;;
summary)
  summary "${2:?usage: scripts/gpu_check.sh summary DIR}"
  exit
  ;;
*)
  echo "usage: scripts/gpu_check.sh run|smoke|summary DIR" >&2
  exit 2
  ;;
esac

attention() {  # $1: index into lengths; $2: seconds allowed; then any further options
  stamp "attention at ${lengths[$1]} tokens"
  timeout "$2" python3 benchmarks/attention.py --device "$device" --dtype "$dtype" "${heads[@]}" \
    --tokens "${lengths[$1]}" --densities 0.1 0.25 0.5 1.0 --masks selected --reps "${reps[$1]}" "${@:3}" \
    --json "$OUT/attention_${lengths[$1]}.json" 2>&1 | tee "$OUT/attention_${lengths[$1]}.log" | tail -16
}

# A short run first compiles the Triton kernels and FlexAttention into their on-disk caches, so that a slow first
# compilation cannot cost a measured part its figures.
stamp "compiling at $warm tokens"
timeout 120 python3 benchmarks/attention.py --device "$device" --dtype "$dtype" "${heads[@]}" --tokens "$warm" \
  --densities 0.25 1.0 --masks selected --reps 1 2>&1 | tee "$OUT/compiling.log" | tail -3
attention 0 80 --count
attention 1 90 --count
stamp "model step"
timeout 130 python3 benchmarks/model_step.py "${model[@]}" --dtype "$dtype" --device "$device" --taus 0.9 \
  --max-densities 0.25 --attention "flex cap=0.25:kernel_backend=flex,tau=1.0,max_density=0.25" \
  --json "$OUT/model_step.json" 2>&1 | tee "$OUT/model_step.log" | tail -8
stamp "CUDA tests"
# test_cuda.py first (pytest keeps the order); SIGINT lets pytest print its result line when the time is up
timeout -s INT 85 python3 -m pytest -q "${tests[@]}" -p no:cacheprovider tests/unit/test_cuda.py tests/unit/kernels \
  2>&1 | tee "$OUT/cuda_tests.log" | tail -12
attention 2 50  # counts are the same at every length (tests); host time matters where kernels are short
stamp "summary"
summary "$OUT" | tee "$OUT/summary.md"
stamp done

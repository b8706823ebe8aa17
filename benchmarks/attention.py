"""Block-sparse attention speed against dense causal SDPA, block selection cost, and launches per layer.

One process, one packed stream. For each density and each kind of mask (``--masks``):

- ``selected``: ``select_blocks`` on the benchmark's inputs with tau = 1 and ``max_density`` = the density
  (the always-kept blocks plus the highest-scored others, the same count in every row of a query block);
- ``scattered``: every head keeps its own random share (the density) of the candidate blocks plus the
  always-kept ones (diagonal, document sinks), so kept tiles are rarely contiguous and counts vary by row.

The density column is the mask's real one (kept over candidate tiles). Variants are timed alternately,
repetition by repetition, and medians are quoted with their ratio to dense: on a shared machine only such
in-run ratios mean anything. On CUDA the dense baselines are SDPA as PyTorch dispatches it, SDPA forced to
cuDNN (on K/V repeated to the query heads, outside the timing) and FlexAttention with every causal block.

``--profile`` adds ``torch.profiler``'s table of one call of the first sparse variant, busiest ops first, and on
the CPU the rate of its matrix products against one large product's and dense SDPA's rate over all of its work.
``--count`` adds what one layer asks of the device, selection plus attention forward and backward, per sparse
backend: kernels launched, host synchronisations, and the host's time per layer. On CUDA the profiler counts the
kernels, ``torch.cuda.set_sync_debug_mode("error")`` catches any synchronisation and the host time is the time
to queue the layer's work, not waiting for it; on the CPU ``kernels.launches`` counts aten ops and Triton launches
(the Triton path under ``TRITON_INTERPRET=1``) and host reads, its tensors standing in for device ones
(``count_launches(as_device=True)``), and times the layer without its Triton kernels (``host_side_only``; at a
small ``--tokens``, so that the aten ops left compute next to nothing). Where the kernels are short, the host's
time is the layer's.

Every sparse variant and layer shares the stream's ``PackedDocuments``, made once outside the timings, as a model's
layers do: no figure per call or layer holds that work, whose launches ``--count`` counts apart, once per
micro-batch.

    python benchmarks/attention.py            # 8192 tokens, 8/2 heads, d 64, block 64
    python benchmarks/attention.py --quick    # small and fast
    python benchmarks/attention.py --device cuda --dtype bf16 --tokens 32768 --q-heads 14 --kv-heads 2 \
        --densities 0.1 0.25 0.5 1.0 --count   # Qwen2.5-0.5B's attention on a GPU
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsebalance_pl.kernels import LayerBudget, PackedDocuments, attention_recall, block_sparse_attention
from sparsebalance_pl.kernels import select_blocks, select_with_budget
from sparsebalance_pl.kernels.launches import count_launches, host_side_only
from sparsebalance_pl.kernels.layout import forced_tiles
from sparsebalance_pl.variants import attempt, one_line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASKS = ("selected", "scattered")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--docs", type=int, default=1, help="equal-length documents in the stream")
    parser.add_argument("--q-heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--stride", type=int, default=16)
    parser.add_argument("--tau", type=float, default=0.9, help="budget whose density and recall are reported")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--masks", nargs="+", choices=MASKS, default=list(MASKS), help="kinds of block mask")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--backends", nargs="+", choices=["torch", "triton", "flex"], default=None,
        help="sparse backends to time (default: torch on the CPU, triton and flex on CUDA)",
    )
    parser.add_argument("--count", action="store_true",
                        help="also count launches and host syncs per layer, and time the host's share (on the CPU: "
                             "the triton backend only, under TRITON_INTERPRET=1)")
    parser.add_argument(
        "--profile", action="store_true",
        help="also print where one forward and backward of the first sparse variant spends its time (torch.profiler)",
    )
    parser.add_argument(
        "--compile-for", type=int, default=None, metavar="ARCH",
        help="only compile one layer's Triton kernels for this CUDA architecture (90: H100 and H200) on meta tensors, "
             "no GPU needed, and print each kernel's registers, spilled bytes and shared memory; nothing is timed",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2048 tokens, 4/2 heads: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.q_heads, args.kv_heads = 2048, 4, 2
    return args


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compile_for is not None:
        return compile_layer(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shape = (args.tokens, args.q_heads, args.head_dim)
    kv_shape = (args.tokens, args.kv_heads, args.head_dim)
    q = torch.randn(shape, generator=gen, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(kv_shape, generator=gen, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(kv_shape, generator=gen, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    cu_seqlens = equal_documents(args.tokens, args.docs, device)
    documents = PackedDocuments(cu_seqlens, args.tokens, args.block_size)  # once for all layers, as a model does
    backends = args.backends or (["triton", "flex"] if device.type == "cuda" else ["torch"])

    def select(tau=1.0, max_density=None):
        return select_blocks(
            q.detach(), k.detach(), documents, block_size=args.block_size, tau=tau, stride=args.stride,
            max_density=max_density, return_stats=True,
        )

    candidates = documents.candidates
    forced = forced_tiles(documents.doc, cu_seqlens, args.block_size)

    def scattered(density):
        keep = torch.rand(args.q_heads, *candidates.shape, generator=gen, device=device) < density
        return (keep & candidates) | forced

    make = {"selected": lambda d: select(max_density=d)[0], "scattered": scattered}
    masks = {(kind, d): make[kind](d) for kind in args.masks for d in args.densities}

    def dense(backward=True):
        def run():
            bounds_list = cu_seqlens.tolist()
            outs = []
            for s, e in zip(bounds_list[:-1], bounds_list[1:]):
                qd, kd, vd = (x[s:e].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)[0])
            out = torch.cat(outs, dim=1).transpose(0, 1)
            if backward:
                torch.autograd.grad(out, (q, k, v), grad)
        return run

    def sparse(mask, backend):
        def run():
            out = block_sparse_attention(q, k, v, mask, documents, block_size=args.block_size, backend=backend)
            torch.autograd.grad(out, (q, k, v), grad)
        return run

    variants = {"dense fwd+bwd": dense(), "dense fwd": dense(backward=False), "selection": lambda: select(args.tau)}
    if device.type == "cuda":
        variants["cudnn fwd+bwd"] = cudnn_dense(q, k, v, grad, cu_seqlens)
        variants["flex dense fwd+bwd"] = sparse(torch.ones_like(candidates).expand(args.q_heads, -1, -1), "flex")
    for key, mask in masks.items():
        for backend in backends:
            variants[(backend, *key)] = sparse(mask, backend)
    failed: dict[str, str] = {}  # variant label -> why it did not run
    for name, fn in variants.items():  # warm-up (and Triton compilation)
        attempt(variant_label(name), failed, timed, fn, device)
    if missing := [name for name in ("dense fwd+bwd", "dense fwd", "selection") if name in failed]:
        if args.json:  # what every ratio needs did not run: only the reasons are left to keep
            Path(args.json).write_text(json.dumps({"tokens": args.tokens, "failed": failed}, indent=1))
        raise SystemExit(f"{missing[0]} failed: {failed[missing[0]]}")
    times = {name: [] for name in variants if variant_label(name) not in failed}
    for _ in range(args.reps):
        for name in list(times):
            seconds = attempt(variant_label(name), failed, timed, variants[name], device)
            if seconds is None:
                del times[name]
            else:
                times[name].append(seconds)
    med = {name: statistics.median(t) for name, t in times.items()}

    mask, stats = select(args.tau)
    recall = attention_recall(q.detach(), k.detach(), mask, cu_seqlens, block_size=args.block_size)
    print(
        f"T={args.tokens} docs={args.docs} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
        f"B={args.block_size} {args.dtype} {device} threads={torch.get_num_threads()} reps={args.reps} (medians)"
    )
    print(
        f"regime: select_blocks(tau={args.tau}, stride={args.stride}) on these random inputs keeps density "
        f"{float(stats.mean_density()):.3f}, exact recall {float(recall):.3f}"
    )
    print(f"{'variant':<18}{'mask':<11}{'density':>9}{'ms':>11}{'/ dense':>9}")
    base = med["dense fwd+bwd"]
    print(f"{'dense sdpa':<18}{'causal':<11}{1.0:>9.3f}{base * 1e3:>11.1f}{1.0:>9.3f}")
    for name in ("cudnn fwd+bwd", "flex dense fwd+bwd"):
        label = name.removesuffix(" fwd+bwd")
        if name in med:
            print(f"{label:<18}{'causal':<11}{1.0:>9.3f}{med[name] * 1e3:>11.1f}{med[name] / base:>9.3f}")
        elif name in failed:
            print(f"{label:<18}{'causal':<11}{1.0:>9.3f}  failed: {failed[name]}")
    for (kind, d), mask in masks.items():
        actual = float((mask & candidates).sum() / (candidates.sum() * args.q_heads))
        for backend in backends:
            key, row = (backend, kind, d), f"{backend + ' sparse':<18}{kind:<11}{actual:>9.3f}"
            print(f"{row}{med[key] * 1e3:>11.1f}{med[key] / base:>9.3f}" if key in med else
                  f"{row}  failed: {failed[variant_label(key)]}")
    sel, fwd = med["selection"], med["dense fwd"]
    print(f"selection (stride {args.stride}): {sel * 1e3:.1f} ms = {sel / fwd:.3f} of dense forward "
          f"({fwd * 1e3:.1f} ms)")
    figures = {
        "tokens": args.tokens, "device": str(device), "dtype": args.dtype, "selection_ms": sel * 1e3,
        "dense_forward_ms": fwd * 1e3,
        "dense_ms": {name.removesuffix(" fwd+bwd"): med[name] * 1e3 for name in med if "fwd+bwd" in name},
        "sparse": [{"backend": backend, "mask": kind, "density": d, "ms": med[(backend, kind, d)] * 1e3}
                   for (kind, d) in masks for backend in backends if (backend, kind, d) in med],
        "failed": failed,
    }

    def save() -> None:  # as each part ends: a run cut short by a time limit keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))

    save()
    if args.count:
        figures["launches"], budgets = {}, layer_budgets(args.tau)
        with count_launches(as_device=True) as per_batch:  # what a model does once for all its layers
            PackedDocuments(cu_seqlens, args.tokens, args.block_size).candidates  # derives the document ids too
        figures["launches_per_micro_batch"] = per_batch.launches
        print(f"launches once per micro-batch (the documents every layer shares): {per_batch.launches}")
        for backend in backends:
            for name, budget in budgets.items():
                label = f"launches {backend} {name}"
                counted = attempt(label, failed, layer_launches, q, k, v, grad, documents, args.block_size,
                                  args.stride, budget, budgets["base"], backend)
                if counted is None:
                    print(f"launches per layer ({backend}, {name} budget): failed: {failed[label]}")
                    continue
                figures["launches"][f"{backend} {name}"] = counted
                launched, host_ms = counted["kernels"], counted["host_ms"]
                host = "" if host_ms is None else f", host time: {host_ms:.3f} ms"
                print(f"launches per layer ({backend}, {name} budget: selection, attention forward and backward): "
                      f"{'not measured' if launched is None else launched}, host syncs: {counted['host_syncs']}{host}")
                if counted.get("busiest"):
                    print(f"  kernel time {counted['kernel_ms']:.3f} ms, busiest: " + ", ".join(
                        f"{k['name']} {k['ms']:.3f} ms ({k['calls']}x)" for k in counted["busiest"]))
                save()
    # the first sparse variant that ran
    if args.profile and (first := next((key for key in times if isinstance(key, tuple)), None)) is not None:
        with torch.profiler.profile() as prof:
            variants[first]()
        print(f"where one call of {' '.join(map(str, first))} spends its time:")
        print(prof.key_averages().table(sort_by="self_device_time_total" if device.type == "cuda"
                                        else "self_cpu_time_total", row_limit=12))
        if device.type == "cpu":
            print(product_rates(prof, masks[first[1:]] & candidates, candidates.sum() * args.q_heads,
                                args.block_size, args.head_dim, base))
    save()
    if failed:
        raise SystemExit(f"{len(failed)} variant(s) failed: {', '.join(failed)}")


def product_rates(prof, kept: torch.Tensor, causal_tiles, block_size: int, head_dim: int,
                  dense_seconds: float) -> str:
    """The profiled call's matrix products (its ``kept`` tiles) against dense SDPA's time on the CPU, and one large
    product's rate, the core's practical peak: both do seven block products per tile (forward two, backward five
    with the scores recomputed), so the rates show how much of each one's time goes to anything but products."""
    flops_per_tile = 7 * 2 * block_size ** 2 * head_dim
    sparse_flops, dense_flops = float(kept.sum()) * flops_per_tile, float(causal_tiles) * flops_per_tile
    bmm_seconds = sum(event.self_cpu_time_total for event in prof.key_averages() if event.key == "aten::bmm") / 1e6
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b  # warm
    peak = 2 * 2048 ** 3 / statistics.median(timed(lambda: a @ b, torch.device("cpu")) for _ in range(5)) / 1e9
    return (f"matrix products: {sparse_flops / 1e9:.4g} GFLOP in {bmm_seconds * 1e3:.1f} ms of bmm "
            f"({sparse_flops / bmm_seconds / 1e9:.0f} GFLOP/s; one 2048^3 product: {peak:.0f} GFLOP/s); dense SDPA: "
            f"{dense_flops / 1e9:.4g} GFLOP of products in {dense_seconds * 1e3:.1f} ms for all of its work "
            f"({dense_flops / dense_seconds / 1e9:.0f} GFLOP/s)")


def variant_label(name) -> str:
    """A variant's key as text: "dense fwd+bwd", or (backend, mask, density) as "triton selected 0.25"."""
    return name if isinstance(name, str) else " ".join(map(str, name))


def cudnn_dense(q, k, v, grad, cu_seqlens):
    """Dense causal attention per document through cuDNN's SDPA, K/V repeated to the query heads beforehand."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    k_full, v_full = (x.detach().repeat_interleave(group, dim=1).requires_grad_() for x in (k, v))
    bounds = cu_seqlens.tolist()

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            outs = [F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k_full, v_full)),
                                                   is_causal=True)[0] for s, e in zip(bounds[:-1], bounds[1:])]
        torch.autograd.grad(torch.cat(outs, dim=1).transpose(0, 1), (q, k_full, v_full), grad)
    return run


def equal_documents(tokens: int, docs: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens of ``docs`` documents of (nearly) equal length in a stream of ``tokens``."""
    return torch.linspace(0, tokens, docs + 1).round().to(device=device, dtype=torch.int32)


def run_layer(q, k, v, grad, cu_seqlens, block_size, stride, budget, base, backend) -> None:
    """One layer's selection and attention, forward and backward, at ``budget`` against ``base``; ``cu_seqlens`` may
    be the stream's ``PackedDocuments``. What a module logs of the selection it reduces over all layers at once, after
    the backward (``sparsebalance_pl.attention.layer_means``): no work of a layer's."""
    selection = select_with_budget(q.detach(), k.detach(), cu_seqlens, budget, base, block_size=block_size,
                                   stride=stride, backend=backend)
    out = block_sparse_attention(q, k, v, selection.mask, cu_seqlens, block_size=block_size, backend=backend)
    torch.autograd.grad(out, (q, k, v), grad)


def layer_budgets(tau: float) -> dict[str, LayerBudget]:
    """The layer's base budget and one DST sets for a straggler (another tau, a tile bound)."""
    return {"base": LayerBudget(tau), "tuned": LayerBudget(min(tau + 0.05, 1.0), None, 0.7)}


def compile_layer(args: argparse.Namespace) -> None:
    """``--compile-for``: every Triton kernel one layer launches at both ``layer_budgets``, compiled for the
    architecture from meta tensors of the benchmark's shapes, dtype and documents, with what each needs of the
    GPU (the most any of a kernel's binaries needs: the selection compiles some kernels once per budget)."""
    from triton.backends.compiler import GPUTarget

    from sparsebalance_pl.kernels.cross_compile import SHARED_MEMORY_KIB, compiling_for, resource_usage

    meta = dict(device="meta", dtype=DTYPES[args.dtype])
    q = torch.empty(args.tokens, args.q_heads, args.head_dim, **meta, requires_grad=True)
    k, v = (torch.empty(args.tokens, args.kv_heads, args.head_dim, **meta, requires_grad=True) for _ in range(2))
    cu_seqlens = equal_documents(args.tokens, args.docs, torch.device("meta"))
    budgets = layer_budgets(args.tau)
    with compiling_for(GPUTarget("cuda", args.compile_for, 32)) as compiled:
        for budget in budgets.values():
            run_layer(q, k, v, torch.empty_like(q), cu_seqlens, args.block_size, args.stride, budget, budgets["base"],
                      "triton")
    worst: dict[str, dict[str, int]] = {}
    for binary in {kernel.hash: kernel for kernel in compiled}.values():
        need, before = resource_usage(binary), worst.get(binary.name, {})
        worst[binary.name] = {key: max(value, before.get(key, 0)) for key, value in need.items()}
    usage = [{"kernel": name, **need} for name, need in worst.items()]
    limit = SHARED_MEMORY_KIB[args.compile_for]
    print(f"one layer's Triton kernels compiled for sm_{args.compile_for} ({limit} KiB of shared memory per program): "
          f"T={args.tokens} docs={args.docs} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"B={args.block_size} {args.dtype}")
    print(f"{'kernel':<20}{'registers':>10}{'spilled B':>11}{'shared KiB':>12}{'stages':>8}")
    for need in usage:
        shared = need["shared_bytes"] / 1024
        print(f"{need['kernel']:<20}{need['registers']:>10}{need['stack_bytes']:>11}{shared:>12.1f}"
              f"{need['stages']:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.compile_for, "dtype": args.dtype,
                                               "head_dim": args.head_dim, "shared_limit_kib": limit,
                                               "kernels": usage}, indent=1))


def layer_launches(q, k, v, grad, documents, block_size, stride, budget, base, backend) -> dict:
    """What ``run_layer`` on the stream's ``PackedDocuments`` asks of the device: ``kernels`` launched, ``host_syncs``,
    the host's median ms (``host_ms``) and, on CUDA, the GPU's ``kernel_ms`` and its ``busiest`` kernels (where a
    layer's time goes). No kernel count where the profiler sees no CUDA kernel; no host time for the torch backend on
    the CPU, whose kernels are the host's own work, nor for a layer that synchronises."""

    def layer():
        run_layer(q, k, v, grad, documents, block_size, stride, budget, base, backend)

    if q.device.type != "cuda":
        with count_launches(as_device=True) as count:
            layer()
        counted = {"kernels": count.launches, "host_syncs": count.host_syncs, "host_ms": None}
        if backend == "triton":
            with host_side_only():
                counted["host_ms"] = host_time_ms(layer, q.device)
        return counted
    layer()  # compiled and cached before counting
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            layer()
        syncs = 0
    except RuntimeError as error:  # a synchronising call raised: name it
        syncs = f"at least one ({one_line(error)})"
        profile = None
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    kernels = [] if profile is None else device_kernels(profile.events(), torch.autograd.DeviceType.CUDA)
    return {
        # none seen: the profiler could not trace the device (no CUPTI), not a layer without kernels
        "kernels": len(kernels) or None,
        "host_syncs": syncs,
        # a layer that synchronises waits for the GPU: its time would not be the host's
        "host_ms": host_time_ms(layer, q.device) if syncs == 0 else None,
        "kernel_ms": sum(ms for _, ms in kernels) if kernels else None,
        "busiest": busiest(kernels),
    }


def device_kernels(events, device_type) -> list[tuple[str, float]]:
    """(name, ms) of each profiled event that ran on ``device_type``, less the ranges annotated on it (they span
    kernels already counted)."""
    return [(event.name, event.time_range.elapsed_us() / 1e3) for event in events
            if event.device_type == device_type and not event.is_user_annotation]


def busiest(kernels: list[tuple[str, float]], top: int = 6) -> list[dict]:
    """The ``top`` kernel names by total time: name (its template arguments and parameters cut), ms and calls."""
    totals: dict[str, list] = {}
    for name, ms in kernels:
        bare = name.removeprefix("void ").replace("(anonymous namespace)::", "")
        short = re.split(r"[<(]", bare, maxsplit=1)[0].strip() or name
        total = totals.setdefault(short, [0.0, 0])
        total[0] += ms
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [{"name": name, "ms": ms, "calls": calls} for name, (ms, calls) in ranked]


def host_time_ms(layer, device: torch.device, reps: int = 20) -> float:
    """Median ms the host spends in ``layer``: on CUDA from an idle device until the work is queued (a launch
    returns before its kernel ends)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        layer()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    main()

"""Decode benchmark (issue 4): FP8 and BF16 kernels, TFLOPS, GB/s and % of the SPEC section 7
roofline, with the ceilings measured in the same run. Prints a table; ``--json`` saves it.

Each decode call (split-KV kernel + combine) is timed as the replay of a CUDA graph, as an
engine runs its decode step: the device time without the Python launch path, which at 16k
contexts took as long as the kernels (up to 19% on the FP8 times). The FP8 default path is also
timed eagerly (``fp8_eager_us``), and ``--eager`` times every call eagerly."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections.abc import Callable

import torch

from snapmla_cli.bench.ceilings import measure_ceilings
from snapmla_cli.bench.decode_case import DecodeCase, extra_defines
from snapmla_cli.bench.results import format_spread
from snapmla_cli.bench.roofline import Ceilings, DecodeWork
from snapmla_cli.bench.timing import (
    BURST,
    CLOCKS,
    Clocks,
    round_spread,
    time_cuda,
    time_cuda_rounds,
    time_graph_rounds,
)
from snapmla_cli.ops.decode_config import (
    DEFAULT_BF16_KERNEL,
    DEFAULT_FP8_KERNEL,
    FP8_MMA_SYNC,
    FP8_WGMMA,
    heuristic_config,
)

Timer = Callable[..., list[float]]  # time_graph_rounds or time_cuda_rounds: each round's seconds per call


def run_case(w: DecodeWork, ceilings: Ceilings, device: torch.device, timer: Timer = time_graph_rounds,
             clocks: Clocks | None = BURST) -> dict[str, object]:
    """One shape: the FP8 and BF16 default paths timed in ``clocks`` (the ceilings' state; each
    with its rounds' spread), the eager FP8 call and each format's other kernel right after them
    (no cool-down of their own)."""
    case = DecodeCase.build([w.context] * w.batch, w.s_q, w.h_q, device)
    res: dict[str, object] = {"batch": w.batch, "s_q": w.s_q, "h_q": w.h_q, "ctx": w.context}
    fp8_default_path = case.fp8()
    rounds8 = timer(fp8_default_path, clocks=clocks)
    res["fp8_eager_us"] = time_cuda(fp8_default_path) * 1e6
    rounds16 = timer(case.bf16(), clocks=clocks)
    t8, t16 = statistics.median(rounds8), statistics.median(rounds16)
    res["fp8_spread"], res["bf16_spread"] = round_spread(rounds8), round_spread(rounds16)
    # each format's other kernel at its own heuristic (the mma.sync ones, the wgmma ones being
    # the defaults)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for name, fp8, default in (("fp8", True, DEFAULT_FP8_KERNEL), ("bf16", False, DEFAULT_BF16_KERNEL)):
        other = FP8_MMA_SYNC if default == FP8_WGMMA else FP8_WGMMA
        alt = heuristic_config(w.s_q * w.h_q, fp8, other).with_sms(sms)
        t_alt = statistics.median(timer(case.fp8(alt) if fp8 else case.bf16(alt)))
        res[f"{name}_default_kernel"] = default
        res[f"{name}v{other}_us"] = t_alt * 1e6
        res[f"{name}v{other}_roof_pct"] = 100 * w.t_min(fp8, ceilings) / t_alt
    for name, t, fp8 in (("fp8", t8, True), ("bf16", t16, False)):
        res[f"{name}_us"] = t * 1e6
        res[f"{name}_tflops"] = w.flops / t / 1e12
        res[f"{name}_gbs"] = w.bytes(fp8) / t / 1e9
        res[f"{name}_roof_pct"] = 100 * w.t_min(fp8, ceilings) / t
    res["speedup"] = t16 / t8
    res["fp8_vs_bf16_roofline"] = w.t_min(False, ceilings) / t8
    return res


BALANCED = "balanced"


def sweep_fp8(w: DecodeWork, specs: str, device: torch.device, timer: Timer = time_graph_rounds,
              clocks: Clocks | None = BURST) -> None:
    """Time FP8 kernel variants (``config_from_spec`` format, optionally followed by
    ``+NAME=VALUE`` extra defines or ``+balanced``, the balanced split policy) on one shape
    (tuning probe; version 3 = wgmma, 2 = mma.sync)."""
    from snapmla_cli.ops.decode_config import balanced, config_from_spec, fp8_config_valid

    case = DecodeCase.build([w.context] * w.batch, w.s_q, w.h_q, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for spec in specs.split(","):
        base, *extras = spec.split("+")
        cfg = config_from_spec(base).with_sms(sms)
        if BALANCED in extras:  # the balanced split policy (columns of work items)
            cfg = balanced(cfg)
        if not fp8_config_valid(cfg):
            continue
        defines = {k: int(v) for k, v in (e.split("=") for e in extras if e != BALANCED)}
        with extra_defines(defines):
            call = case.fp8(cfg)
            t = statistics.median(timer(call, clocks=clocks))
        print(f"sweep h{w.h_q} s_q{w.s_q} ctx{w.context} {spec:18s} work{call.work_items}: "
              f"{t*1e6:9.1f}us {w.bytes(True)/t/1e9:6.0f}GB/s {w.flops/t/1e12:6.1f}TF", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", default="16,32,64,128")
    ap.add_argument("--mtp", default="1,2")
    ap.add_argument("--ctx", default="16384,32768,65536,131072")
    ap.add_argument("--json")
    ap.add_argument("--eager", action="store_true", help="time eager launches instead of CUDA-graph replays")
    ap.add_argument("--clocks", choices=sorted(CLOCKS), default=BURST.name,
                    help="burst: boost clock (idle, brief warm-up); steady: after 0.2 s of work, power-capped")
    ap.add_argument("--sweep", help="FP8 variants version:rg:kv:stages:ctas[:qk_promote:pv_promote[:wg_mode]],"
                                    "... timed on each shape instead; a spec may end in +NAME=VALUE extra kernel defines "
                                    "or +balanced (the balanced split policy)")
    args = ap.parse_args()
    device = torch.device("cuda")
    timer = time_cuda_rounds if args.eager else time_graph_rounds
    if args.sweep:
        for h in map(int, args.heads.split(",")):
            for s in map(int, args.mtp.split(",")):
                for ctx in map(int, args.ctx.split(",")):
                    sweep_fp8(DecodeWork(args.batch, s, h, ctx, causal=True), args.sweep, device, timer, CLOCKS[args.clocks])
        return
    clocks = CLOCKS[args.clocks]
    c = measure_ceilings(device, clocks)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"GPU {torch.cuda.get_device_name()} commit {commit} clocks {clocks.name}: bf16 {c.p16/1e12:.0f} TFLOP/s, "
          f"fp8 {c.p8/1e12:.0f} TFLOP/s, copy {c.bandwidth/1e12:.2f} TB/s", flush=True)
    rows = []
    for h in map(int, args.heads.split(",")):
        for s in map(int, args.mtp.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                r = run_case(DecodeWork(args.batch, s, h, ctx, causal=True), c, device, timer, clocks)
                rows.append(r)
                spreads = " / ".join(format_spread(v if isinstance(v, float) else None)
                                     for v in (r["fp8_spread"], r["bf16_spread"]))
                print(f"h{h:4d} s_q{s} ctx{ctx:7d} | fp8 {r['fp8_us']:9.1f}us {r['fp8_tflops']:6.1f}TF "
                      f"{r['fp8_gbs']:6.0f}GB/s {r['fp8_roof_pct']:5.1f}% | bf16 {r['bf16_us']:9.1f}us "
                      f"{r['bf16_tflops']:6.1f}TF {r['bf16_gbs']:6.0f}GB/s {r['bf16_roof_pct']:5.1f}% | "
                      f"x{r['speedup']:.2f} vsBF16roof x{r['fp8_vs_bf16_roofline']:.2f} | "
                      f"spread {spreads} | "
                      f"fp8 eager {r['fp8_eager_us']:9.1f}us | "
                      + " ".join(f"{k[:-3]} {v:9.1f}us" for k, v in r.items()
                                 if k.startswith(("fp8v", "bf16v")) and k.endswith("_us")),
                      flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ceilings": c.__dict__, "commit": commit, "timing": "eager" if args.eager else "graph",
                       "clocks": clocks.name,
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

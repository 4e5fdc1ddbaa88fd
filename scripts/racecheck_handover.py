"""Run the barrier skeleton of the decode kernel's alternate-pages mode under racecheck:
``compute-sanitizer --tool racecheck python3 scripts/racecheck_handover.py [PRODUCER=1,REGS=1,EPI_BAR=3]``.

`kernels/diag/handover_race.cu` keeps only the synchronization of WG_MODE 3 (setmaxnreg, the
full / empty mbarrier handshake, the `bar.arrive` / `bar.sync` hand-overs of alternate pages and
the epilogue's consumer barriers around the L partials), so a hazard racecheck reports on it is
one about the tool's model of that pattern (docs/DESIGN.md, "Racecheck, open"). The kernel runs
twice and the outputs must agree bitwise (a real race would show there too).
"""

from __future__ import annotations

import sys

import torch

from snapmla_cli.runtime import launch

SOURCE, KERNEL = "diag/handover_race.cu", "snapmla_diag_handover"
THREADS, CONSUMERS = 384, 256
CTAS, MAX_BLOCKS = 264, 9  # two waves on 132 SMs, 0..9 pages per CTA (odd and even counts, none)


def main() -> None:
    defines = {"PRODUCER": 1, "REGS": 1, "EPI_BAR": 3}
    if len(sys.argv) > 1:
        defines.update({k: int(v) for k, v in (item.split("=") for item in sys.argv[1].split(","))})
    kernel = launch.get_kernel(SOURCE, KERNEL, defines)
    gen = torch.Generator().manual_seed(7)
    num_blocks = torch.randint(0, MAX_BLOCKS + 1, (CTAS,), generator=gen, dtype=torch.int32)
    device_blocks = num_blocks.cuda()
    outs = []
    for _ in range(2):
        out = torch.full((CTAS * CONSUMERS,), float("nan"), device="cuda")
        kernel((CTAS, 1, 1), (THREADS, 1, 1), (device_blocks.data_ptr(), out.data_ptr()))
        outs.append(out)
    torch.cuda.synchronize()
    print(f"{defines}: {CTAS} CTAs, pages per CTA {num_blocks.min().item()}..{num_blocks.max().item()}; "
          f"finite {bool(outs[0].isfinite().all())}, runs equal {torch.equal(outs[0], outs[1])}", flush=True)


if __name__ == "__main__":
    main()

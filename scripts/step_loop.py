"""An engine's decode loop in eager mode: per step ``get_mla_metadata`` (the lengths read from the
GPU, which waits for the stream, or given on the host with ``device=``), then ``layers`` layers of
``quantize_q`` + ``decode_fp8`` on that step's work list, each layer on its own cache (a view one
page further into one buffer: its own address, as an engine's layers have, without 61 copies of
the cache); every length one token longer each step, the requests' lengths spread over a page so
that the planner's caches miss as in a real batch. ``--flash-mla``: each layer calls
``flash_mla_with_kvcache`` instead (its fused Q-quant + decode plan).

Prints the wall time per step of both loops against the GPU time of one step's layers (the same
launches replayed from a CUDA graph): what the host leaves the GPU idle per step; and the step of
an engine that captured its layers once in a CUDA graph with a ``GraphWorkList`` (rewritten from
the host lengths each step, then the graph replayed).

    python3 scripts/step_loop.py --heads 16,128 --batch 1,8,64 --layers 61
"""

from __future__ import annotations

import argparse

import torch
from bench_prep import host_time  # this folder is sys.path[0]

from snapmla_cli.bench.decode_case import DecodeCase
from snapmla_cli.bench.timing import capture_graph, time_graph
from snapmla_cli.numerics.formats import D_V, PAGE_SIZE
from snapmla_cli.ops.decode import decode_fp8, flash_mla_with_kvcache, get_mla_metadata
from snapmla_cli.ops.graph_work_list import GraphWorkList
from snapmla_cli.ops.prep import quantize_q

STEPS = 2 * PAGE_SIZE  # every request starts a page twice
WARMUP_STEPS = 16  # at least host_time's warm-up calls


def measure(b: int, h: int, ctx: int, layers: int, device: torch.device, flash_mla: bool) -> None:
    """Print one shape's step times: GPU only (graph), eager with GPU lengths, eager with host
    lengths, and graph replays with a GraphWorkList."""
    spread = torch.randint(0, PAGE_SIZE, (b,), generator=torch.Generator().manual_seed(b * 131 + h))
    final = [ctx - int(s) for s in spread]  # the cache holds the last step's tokens
    case = DecodeCase.build(final, 1, h, device)
    rows = case.rows
    blocks = case.cache8.shape[0]
    pages = torch.cat([case.cache8] * (1 + -(-(layers - 1) // blocks)))  # room for the layers' offsets
    layer_caches = [pages[layer : layer + blocks] for layer in range(layers)]

    def layers_of(meta: torch.Tensor, splits: torch.Tensor, lens: torch.Tensor) -> None:
        for cache in layer_caches:
            if flash_mla:
                flash_mla_with_kvcache(case.q, cache, case.table, lens, D_V, meta, splits, None, True)
            else:
                decode_fp8(quantize_q(case.q), cache, case.table, lens, meta, splits, None, True)

    def first_lengths() -> tuple[torch.Tensor, torch.Tensor]:
        """The lengths on the host and on the GPU before the first step: the loop's steps end at
        or before the case's lengths."""
        lens_host = case.lens.cpu() - (STEPS + WARMUP_STEPS)
        return lens_host, lens_host.to(device)

    def loop(host: bool) -> float:
        """Seconds per step of STEPS steps that end at the case's lengths."""
        lens_host, lens_gpu = first_lengths()

        def step() -> None:
            lens_host.add_(1)
            lens_gpu.add_(1)  # an engine's own update of the lengths the kernels read
            if host:
                meta, splits = get_mla_metadata(lens_host, rows, 1, fp8=True, device=device)
            else:
                meta, splits = get_mla_metadata(lens_gpu, rows, 1, fp8=True)
            layers_of(meta, splits, lens_gpu)

        return host_time(step, STEPS)

    def graph_loop() -> float:
        """Seconds per step of an engine that captured its step once: a GraphWorkList rewritten
        from the host lengths, then the graph of the layers replayed."""
        work = GraphWorkList(b, rows, device, max_context=ctx)  # the block table's reach
        lens_host, lens_gpu = first_lengths()
        work.update(lens_host)
        graph = capture_graph(lambda: layers_of(work.metadata, work.num_splits, lens_gpu))

        def step() -> None:
            lens_host.add_(1)
            lens_gpu.add_(1)
            work.update(lens_host)
            graph.replay()

        return host_time(step, STEPS)

    meta, splits = get_mla_metadata(case.lens, rows, 1, fp8=True)
    gpu = time_graph(lambda: layers_of(meta, splits, case.lens), reps=5, warmup=2)
    loop(host=False), loop(host=True)  # every configuration the steps choose built and loaded
    on_gpu, on_host = loop(host=False), loop(host=True)
    graphed = graph_loop()
    call = "flash_mla_with_kvcache" if flash_mla else "quantize_q + decode_fp8"
    print(f"b{b} h{h} {ctx // 1024}k, {layers} layers of {call}: GPU (graph) {gpu * 1e3:.3f} ms/step, eager with GPU lengths "
          f"{on_gpu * 1e3:.3f} ms, with host lengths {on_host * 1e3:.3f} ms ({on_gpu / on_host:.3f}x), "
          f"graph replays with a GraphWorkList {graphed * 1e3:.3f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--flash-mla", action="store_true", help="each layer calls flash_mla_with_kvcache")
    args = ap.parse_args()
    device = torch.device("cuda")
    for b in map(int, args.batch.split(",")):
        for h in map(int, args.heads.split(",")):
            measure(b, h, args.ctx, args.layers, device, args.flash_mla)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

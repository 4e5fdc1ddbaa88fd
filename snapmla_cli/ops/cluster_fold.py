"""The split merge of a thread-block cluster: a request's splits launched together, merged
through each other's shared memory.

Why: at b 64 every split request has the same number of splits (two, at 16-64 rows), and the
split merge folded into the decode kernel (:mod:`.split_fold`) puts the call's last microseconds
on one CTA per request: it stores its partial rows to L2, waits for an arrival counter, reads
every split's partial back and merges them alone (3.3-4.4 us of a 182 us call at h32 s1 16k,
docs/PERF.md). Launched as one cluster of ``n`` CTAs (``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``,
``1 x n x 1`` over the grid's items), the splits keep their rows in their own shared memory,
sync once, and each merges ``512 / n`` of the output dims from all of them
(``kernels/decode_common.cuh`` ``cluster_fold``; the same float32 operations as the fold and
the combine, so the same bits).

It applies when every request with keys has the same split count ``n`` in
:data:`CLUSTER_SIZES`, the work list places each request's splits side by side in split order
at a multiple of ``n`` (``schedule`` orders such plans so), one item per CTA, a wgmma kernel
(FP8 or the BF16 baseline) runs, and the GPU can hold every cluster of the grid at once (a cluster's CTAs are
placed together on one GPC: where the grid's clusters do not fit in one wave, the plan's one
wave of CTAs would become two). ``SNAPMLA_CLUSTER_FOLD=0`` turns it off (A/B timing, an escape
hatch), as ``SNAPMLA_PDL=0`` does for programmatic launches.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..env_switch import env_switch

# cluster sizes the kernel merges (decode_common.cuh cluster_fold: 512 dims split evenly, at
# most the portable cluster size of 8)
CLUSTER_SIZES = (2, 4, 8)
WORK_REQUEST, WORK_BEGIN, WORK_END, WORK_PARTIAL = 0, 1, 2, 3  # fields of a work-list entry (decode_common.cuh WorkItem)


# the build switch of the wgmma kernels' cluster merge (decode_fp8_wgmma.cu, decode_bf16_wgmma.cu)
CLUSTER_FOLD_DEFINE = "CLUSTER_FOLD"


def cluster_defines(defines: Mapping[str, int]) -> dict[str, int]:
    """A wgmma build's defines with its cluster merge on: the variant a plan that launches
    clusters needs (decode.py), that CI compiles (runtime/registry.py) and that the tuner
    compiles ahead with the rest (tuning/space.py kernel_keys)."""
    return {**defines, CLUSTER_FOLD_DEFINE: 1}


def enabled() -> bool:
    """Cluster launches unless ``SNAPMLA_CLUSTER_FOLD=0`` (read when a decode call is planned)."""
    return env_switch("SNAPMLA_CLUSTER_FOLD", True)


def uniform_split_count(counts: np.ndarray) -> int:
    """The split count ``n`` shared by every request that has keys, if it is a cluster size;
    0 otherwise (mixed counts, a request of one split, or no keys at all)."""
    present = counts[counts > 0]
    if not len(present) or not (present == present[0]).all():
        return 0
    n = int(present[0])
    return n if n in CLUSTER_SIZES else 0


def work_list_cluster(work: np.ndarray, cumulative: np.ndarray) -> int:
    """The cluster size a work list ``[columns, items_per_column, 4]`` can be launched with
    (see the module docstring), checked on the table itself; 0 when it cannot."""
    if work.ndim != 3 or work.shape[1] != 1 or not len(work):
        return 0
    n = uniform_split_count(np.diff(cumulative))
    items = work[:, 0, :]
    if n == 0 or len(items) % n:
        return 0
    request = items[:, WORK_REQUEST].astype(np.int64)
    rank = np.arange(len(items)) % n
    first = request[np.arange(len(items)) - rank]
    # every place of a cluster holds the same request, rank s its split s (partial slot
    # cumulative[request] + s): so no place is empty either
    same_request = (request == first).all()
    in_split_order = (items[:, WORK_PARTIAL] == cumulative[request] + rank).all()
    has_blocks = (items[:, WORK_END] > items[:, WORK_BEGIN]).all()
    return n if same_request and in_split_order and has_blocks else 0


def planned_cluster(cluster: int, capable: bool) -> int:
    """The cluster size a decode launch is planned with, before the GPU's occupancy check: the
    work list's (``SplitFold.cluster``) where the kernel can merge in clusters (``capable``:
    ``decode_config.cluster_capable``), unless turned off; 0 otherwise."""
    return cluster if cluster and capable and enabled() else 0


def holds_a_wave(function_ptr: int, cluster: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                 shared_mem: int, slots: int) -> bool:
    """Whether the GPU holds as many of the grid's CTAs at once in clusters of ``cluster`` as
    without clusters (``slots``: the split policy's SMs x CTAs per SM, or the whole grid if
    smaller), so that the plan's waves stay its waves."""
    from ..runtime.cluster_launch import max_active_clusters  # (needs the driver: imported late)

    ctas = grid[0] * grid[1] * grid[2]
    return max_active_clusters(function_ptr, (1, cluster, 1), block, shared_mem) * cluster >= min(ctas, slots)

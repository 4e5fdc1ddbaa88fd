"""The decode calls' prepared launches (ops/decode_launch.py), on CPU tensors: the first call of
a signature checks everything and stores a plan, later calls replay it with their own pointers,
and nothing that changes the launch (a new metadata tensor, another configuration object, a
kernel build switch, forgotten kernels) reuses a stale plan. The launches are recorded instead of
run; the GPU tests run the real ones."""

from __future__ import annotations

import re
import types

import pytest
import torch

from snapmla_cli.bench.decode_case import extra_defines
from snapmla_cli.errors import SnapmlaError
from snapmla_cli.numerics.formats import D_QK, FP8_TOKEN_BYTES, PAGE_SIZE
from snapmla_cli.numerics.quant import QuantizedRows
from snapmla_cli.ops import decode, decode_launch
from snapmla_cli.ops.decode import decode_bf16, decode_fp8, get_mla_metadata
from snapmla_cli.ops.decode_config import heuristic_config
from snapmla_cli.runtime import launch, tensor_map

H_Q, S_Q, BATCH, CTX = 16, 1, 2, 40000  # 625 pages a request: more splits than the fold takes (combine)


class _Recorder:
    """Stands in for the runtime: hands out fake kernels, records each launch's kernel and
    arguments (the decode launch, then the combine's)."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple, list]] = []
        self.builds: list[tuple[str, tuple]] = []  # (source, sorted defines) of every kernel looked up

    @property
    def kernels_built(self) -> int:
        return len(self.builds)

    def get_kernel(self, source, name, defines=None, **_):
        self.builds.append((source, tuple(sorted(dict(defines or {}).items()))))
        return types.SimpleNamespace(name=name, source=source, defines=dict(defines or {}), device_index=0,
                                     max_dynamic_smem=1 << 20, function=types.SimpleNamespace(ptr=0))

    def launch_raw(self, kernel, grid, block, args, shared_mem=0, programmatic=False):
        self.launches.append((kernel.name, tuple(grid), list(args)))

    def launch_prepared(self, kernel, prepared, grid, block, args, shared_mem=0):
        self.launches.append((kernel.name, tuple(grid), list(args)))


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(decode, "_require_cuda", lambda t, name, device: None)
    monkeypatch.setattr(decode, "require_arch", lambda source, index: None)  # a Hopper GPU
    monkeypatch.setattr(decode, "_runtime", lambda: rec)
    monkeypatch.setattr(decode_launch, "launch_raw", rec.launch_raw)
    monkeypatch.setattr(decode_launch, "launch_prepared", rec.launch_prepared)
    monkeypatch.setattr(decode_launch, "prepare_programmatic", lambda *a: None)
    monkeypatch.setattr(decode_launch, "prepare_plain", lambda *a: None)
    monkeypatch.setattr(tensor_map, "fp8_cache_tensor_maps", lambda cache: cache)
    monkeypatch.setattr(tensor_map, "bf16_cache_tensor_map", lambda cache: cache)
    decode_launch.clear_plans()
    yield rec
    decode_launch.clear_plans()


def _q8(seed: int = 0) -> QuantizedRows:
    gen = torch.Generator().manual_seed(seed)
    return QuantizedRows(torch.randint(0, 0x70, (BATCH, S_Q, H_Q, 512), dtype=torch.uint8, generator=gen),
                         torch.rand(BATCH, S_Q, H_Q, generator=gen) + 0.5,
                         torch.randn(BATCH, S_Q, H_Q, 64, generator=gen).to(torch.bfloat16))


def _paged():
    pages = -(-CTX // PAGE_SIZE)
    cache = torch.zeros(BATCH * pages, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    table = torch.arange(BATCH * pages, dtype=torch.int32).view(BATCH, pages)
    lens = torch.full((BATCH,), CTX, dtype=torch.int32)
    return cache, table, lens


def test_second_call_replays_the_plan_with_its_own_pointers(recorder):
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    first_q, second_q = _q8(0), _q8(1)
    out1, lse1 = decode_fp8(first_q, cache, table, lens, meta, splits)
    built = recorder.kernels_built
    out2, lse2 = decode_fp8(second_q, cache, table, lens, meta, splits)
    assert recorder.kernels_built == built, "the second call looked its kernels up again"
    assert len(recorder.launches) == 4  # decode + combine, twice
    (name1, grid1, args1), (cname1, _, cargs1) = recorder.launches[:2]
    (name2, grid2, args2), (cname2, _, cargs2) = recorder.launches[2:]
    assert (name1, grid1, cname1) == (name2, grid2, cname2) == (name1, grid1, "snapmla_combine")
    # Q's pointers and the outputs' are this call's; everything else is the same
    assert args1[:3] == [t.data_ptr() for t in (first_q.content, first_q.scale, first_q.rope)]
    assert args2[:3] == [t.data_ptr() for t in (second_q.content, second_q.scale, second_q.rope)]
    assert args2[8:10] == [out2.data_ptr(), lse2.data_ptr()] and args1[8:10] == [out1.data_ptr(), lse1.data_ptr()]
    assert args1[3:8] == args2[3:8] and args1[12:] == args2[12:]
    assert cargs2[3:5] == [out2.data_ptr(), lse2.data_ptr()] and cargs1[5:] == cargs2[5:]
    assert out2.shape == (BATCH, S_Q, H_Q, 512) and lse2.shape == (BATCH, H_Q, S_Q)


def test_a_new_metadata_tensor_or_config_object_gets_its_own_plan(recorder):
    cache, table, lens = _paged()
    q = _q8()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode_fp8(q, cache, table, lens, meta, splits)
    built = recorder.kernels_built
    meta2, splits2 = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode_fp8(q, cache, table, lens, meta2, splits2)
    assert recorder.kernels_built > built  # planned afresh
    config = heuristic_config(S_Q * H_Q, True).with_sms(8)
    built = recorder.kernels_built
    decode_fp8(q, cache, table, lens, meta2, splits2, config=config)
    assert recorder.kernels_built > built
    plan = decode_launch._PLANS[next(reversed(decode_launch._PLANS))]
    assert (plan.holds_for(meta2, splits2, config) and not plan.holds_for(meta2, splits2, None)
            and not plan.holds_for(meta, splits2, config))


@pytest.mark.parametrize("kernel", ["wgmma", "mma.sync"])
def test_each_layers_cache_replays_the_steps_plan(recorder, monkeypatch, kernel):
    """An engine's step: one work list, every layer on its own cache. The second layer's call
    replays the first one's plan (no planning, no kernel lookup) with its own cache: the wgmma
    kernels get that cache's TMA maps, the mma.sync kernels the cache itself."""
    from snapmla_cli.ops.decode_config import FP8_MMA_SYNC

    maps_of: dict[int, torch.Tensor] = {}  # a distinct stand-in buffer per cache address
    monkeypatch.setattr(tensor_map, "fp8_cache_tensor_maps",
                        lambda cache: maps_of.setdefault(cache.data_ptr(), torch.zeros(256, dtype=torch.uint8)))
    config = None if kernel == "wgmma" else heuristic_config(S_Q * H_Q, True, FP8_MMA_SYNC).with_sms(8)
    layer_caches = [_paged()[0] for _ in range(3)]
    _, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1, config=config)
    q = _q8()
    decode_fp8(q, layer_caches[0], table, lens, meta, splits, config=config)
    built = recorder.kernels_built
    for cache in layer_caches[1:]:
        decode_fp8(q, cache, table, lens, meta, splits, config=config)
    assert recorder.kernels_built == built and len(decode_launch._PLANS) == 1
    cache_args = [args[3] for name, _, args in recorder.launches if name != "snapmla_combine"]
    if kernel == "wgmma":
        expected = [maps_of[cache.data_ptr()].data_ptr() for cache in layer_caches]
    else:
        expected = [cache.data_ptr() for cache in layer_caches]
    assert cache_args == expected and len(set(expected)) == 3


def test_the_plans_of_freed_work_lists_are_dropped(recorder):
    """An eager loop makes a work list per step: the plans of the steps gone must not pile up
    (each holds its fold counters) until MAX_PLANS clears every plan, the live ones too."""
    cache, table, lens = _paged()
    q = _q8()
    kept_meta, kept_splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode_fp8(q, cache, table, lens, kept_meta, kept_splits)
    for _ in range(6):
        meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
        decode_fp8(q, cache, table, lens, meta, splits)
        del meta, splits
    # the kept list's plan, and the last step's until the next first call drops it
    assert len(decode_launch._PLANS) == 2
    assert any(plan.metadata() is kept_meta for plan in decode_launch.stored_plans())
    decode_fp8(q, cache, table, lens, kept_meta, kept_splits)  # still replayed
    assert len(decode_launch._PLANS) == 2


def test_a_kernel_build_switch_or_forgotten_kernels_drop_the_plans(recorder):
    cache, table, lens = _paged()
    q = _q8()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode_fp8(q, cache, table, lens, meta, splits)
    assert decode_launch._PLANS
    with extra_defines({"PV_PAIRS": 0}):
        assert not decode_launch._PLANS
        decode_fp8(q, cache, table, lens, meta, splits)
        switched = recorder.launches[-2]
    assert not decode_launch._PLANS
    decode_fp8(q, cache, table, lens, meta, splits)
    assert recorder.launches[-2][0] == switched[0]
    launch.clear_loaded_kernels()
    assert not decode_launch._PLANS


def test_a_replayed_call_still_checks_what_the_key_cannot_see(recorder):
    cache, table, lens = _paged()
    q = _q8()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode_fp8(q, cache, table, lens, meta, splits)
    strided = QuantizedRows(torch.empty(BATCH, S_Q, H_Q, 1024, dtype=torch.uint8)[..., :512], q.scale, q.rope)
    with pytest.raises(SnapmlaError, match="q.content: must be contiguous"):
        decode_fp8(strided, cache, table, lens, meta, splits)
    wide = torch.zeros(BATCH, 2 * table.shape[1], dtype=torch.int32)[:, ::2]
    with pytest.raises(SnapmlaError, match="block_table"):
        decode_fp8(q, cache, wide, lens, meta, splits)
    with pytest.raises(SnapmlaError, match=r"out: expected shape"):
        decode_fp8(q, cache, table, lens, meta, splits, out=torch.empty(1, 2, 3, dtype=torch.bfloat16))
    out = torch.empty(BATCH, S_Q, H_Q, 512, dtype=torch.bfloat16)
    assert decode_fp8(q, cache, table, lens, meta, splits, out=out)[0] is out
    with pytest.raises(SnapmlaError, match=r"out: expected bfloat16, got "):
        decode_fp8(q, cache, table, lens, meta, splits, out=out.float())


def test_arguments_that_are_not_tensors_get_one_line_errors(recorder):
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    with pytest.raises(SnapmlaError, match="q: expected QuantizedRows"):
        decode_fp8(torch.zeros(1), cache, table, lens, meta, splits)
    with pytest.raises(SnapmlaError, match="block_table: expected a torch.Tensor, got list"):
        decode_fp8(_q8(), cache, [[0]], lens, meta, splits)
    with pytest.raises(SnapmlaError, match="k_cache: expected a torch.Tensor, got NoneType"):
        decode_bf16(torch.zeros(BATCH, S_Q, H_Q, D_QK, dtype=torch.bfloat16), None, table, lens, meta, splits)
    with pytest.raises(SnapmlaError, match="k_cache: expected a torch.Tensor, got NoneType"):  # was AttributeError
        decode.flash_mla_with_kvcache(torch.zeros(BATCH, S_Q, H_Q, D_QK, dtype=torch.bfloat16), None, table, lens,
                                      512, meta, splits)
    q = _q8()
    for replay in (False, True):  # a first call, then one with a stored plan
        if replay:
            decode_fp8(q, cache, table, lens, meta, splits)
        with pytest.raises(SnapmlaError, match="^out: expected a torch.Tensor or None, got list"):
            decode_fp8(q, cache, table, lens, meta, splits, out=[1])
        with pytest.raises(SnapmlaError, match="^lse: expected a torch.Tensor or None, got str"):
            decode_bf16(torch.zeros(BATCH, S_Q, H_Q, D_QK, dtype=torch.bfloat16), cache, table, lens, meta, splits,
                        lse="x")
        with pytest.raises(SnapmlaError, match="^block_table: expected"):  # 0-d: was an IndexError in the key
            decode_fp8(q, cache, torch.tensor(0, dtype=torch.int32), lens, meta, splits)


@pytest.mark.parametrize("scale, needle", [(float("nan"), "a finite number"), (float("-inf"), "a finite number"),
                                          ("0.1", "a number or None"), (-0.04, "a number >= 0"),
                                          (10**400, "a finite number, got one beyond the float range")])
def test_a_softmax_scale_that_is_not_a_finite_number_or_is_negative_is_refused(recorder, scale, needle):
    """Every output would be NaN (or the call would fail deep in the plan): one line naming it."""
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    with pytest.raises(SnapmlaError, match=f"softmax_scale: expected {needle}"):
        decode_fp8(_q8(), cache, table, lens, meta, splits, softmax_scale=scale)
    assert not recorder.launches
    decode_fp8(_q8(), cache, table, lens, meta, splits, softmax_scale=0.1)  # a number plans and runs
    assert recorder.launches


def test_the_tuners_precompile_lists_every_build_a_b64_call_loads(recorder, monkeypatch):
    """b 64 equal lengths: each request's splits run as one cluster, in the CLUSTER_FOLD build.
    The tuner compiles its candidates ahead (tuning.space.kernel_keys) so that no compile lands in
    a bucket's budget; the thirty-fourth session found this build missing from that list."""
    from snapmla_cli.tuning.space import kernel_keys

    class FakeClusterLaunch:
        def __init__(self, ptr, grid, block, shared_mem, dims):
            self.dims = dims

        def __call__(self, stream, args):
            recorder.launches.append(("cluster", self.dims, list(args)))

    monkeypatch.setattr(decode, "holds_a_wave", lambda *a: True)
    monkeypatch.setattr(decode, "ClusterLaunch", FakeClusterLaunch)
    monkeypatch.setattr(decode_launch, "current_raw_stream", lambda index: 0)
    batch, rows, ctx = 64, 16, 16384
    cache = torch.zeros(1, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    table = torch.zeros(batch, ctx // PAGE_SIZE, dtype=torch.int32)  # every page the same block
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = QuantizedRows(torch.zeros(batch, 1, rows, 512, dtype=torch.uint8), torch.ones(batch, 1, rows),
                      torch.zeros(batch, 1, rows, 64, dtype=torch.bfloat16))
    cfg = heuristic_config(rows, True).with_sms(132)
    meta, splits = get_mla_metadata(lens, rows, 1, config=cfg)
    decode_fp8(q, cache, table, lens, meta, splits, config=cfg)
    assert recorder.launches and recorder.launches[0][0] == "cluster"
    decode_builds = [b for b in recorder.builds if b[0] == "decode_fp8_wgmma.cu"]
    assert decode_builds and set(decode_builds) <= set(kernel_keys(cfg, "fp8"))
    assert any(dict(defines).get("CLUSTER_FOLD") == 1 for _, defines in decode_builds)


def test_bf16_calls_replay_their_plan(recorder):
    _, table, lens = _paged()
    cache = torch.zeros(table.numel(), PAGE_SIZE, 1, D_QK, dtype=torch.bfloat16)
    q = torch.randn(BATCH, S_Q, H_Q, D_QK).to(torch.bfloat16)
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1, fp8=False)
    decode_bf16(q, cache, table, lens, meta, splits)
    built = recorder.kernels_built
    q2 = q.clone()
    decode_bf16(q2, cache, table, lens, meta, splits)
    assert recorder.kernels_built == built
    assert recorder.launches[-2][2][0] == q2.data_ptr()


def test_a_plan_does_not_keep_the_callers_cache_alive(recorder):
    """The mma.sync kernels take the cache itself (no TMA maps): its plan holds the pointer, not
    the tensor, so a freed cache is freed (a plan holding a 60 GB cache would leak it)."""
    import gc
    import weakref

    from snapmla_cli.ops.decode_config import FP8_MMA_SYNC

    cache, table, lens = _paged()
    config = heuristic_config(S_Q * H_Q, True, FP8_MMA_SYNC).with_sms(8)
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1, config=config)
    decode_fp8(_q8(), cache, table, lens, meta, splits, config=config)
    assert decode_launch._PLANS
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is None


def test_the_plan_builds_its_kernels_for_the_tensors_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process driving several GPUs: the kernels of a call on cuda:1 must be cuda:1's (each
    belongs to its device's context), not the current device's."""
    from snapmla_cli.ops.decode_config import variant_config

    devices: list[object] = []

    def get_kernel(source: str, name: str, defines: object = None, *, device: object = None, dynamic_smem: int = 0):
        devices.append(device)
        return types.SimpleNamespace(function=types.SimpleNamespace(ptr=0), device_index=device)

    monkeypatch.setattr(decode, "_runtime", lambda: types.SimpleNamespace(get_kernel=get_kernel))
    monkeypatch.setattr(decode, "combine_launch", lambda kernel, grid: None)
    monkeypatch.setattr(decode, "decode_launch", lambda *a: None)
    meta = torch.zeros((4, 1, 4), dtype=torch.int32)
    meta[:, 0, 2] = 1  # four one-block items
    meta[:, 0, 3] = torch.tensor([0, 1, 2, 3])  # partial slots: the combine runs too
    decode._decode_plan(True, torch.zeros((8, 64, 656), dtype=torch.uint8), (2, 1, 16), torch.device("cuda", 1), 4,
                        meta, torch.tensor([0, 2, 4], dtype=torch.int32), None, False, variant_config(16, 2), None)
    assert len(devices) == 2 and all(device == 1 for device in devices), devices  # the decode, the combine


def _offset_view(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t``'s values in a contiguous view that starts ``elements`` elements into a larger buffer."""
    buffer = torch.zeros(t.numel() + elements, dtype=t.dtype)
    view = buffer[elements:].view(t.shape)
    view.copy_(t)
    return view


def test_views_at_an_odd_offset_are_refused_on_first_calls_and_replays(recorder):
    """The kernels read q, its E4M3 content and RoPE, and the cache with 16-byte accesses: a
    contiguous view at an odd offset passes every shape check and would fault on the GPU (a
    misaligned address ends the CUDA context). A first call and a replay both refuse it."""
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    q = _q8()
    odd_content = QuantizedRows(_offset_view(q.content, 3), q.scale, q.rope)
    with pytest.raises(SnapmlaError, match="^q.content: data must start on a 16-byte boundary"):
        decode_fp8(odd_content, cache, table, lens, meta, splits)  # no plan yet: the first call
    with pytest.raises(SnapmlaError, match="^k_cache: data must start on a 16-byte boundary"):
        decode_fp8(q, _offset_view(cache, 8), table, lens, meta, splits)
    decode_fp8(q, cache, table, lens, meta, splits)  # a plan now
    with pytest.raises(SnapmlaError, match="^k_cache: data must start on a 16-byte boundary"):
        decode_fp8(q, _offset_view(cache, 8), table, lens, meta, splits)  # same shape: the replay
    odd_rope = QuantizedRows(q.content, q.scale, _offset_view(q.rope, 1))
    with pytest.raises(SnapmlaError, match="^q.rope: data must start on a 16-byte boundary"):
        decode_fp8(odd_rope, cache, table, lens, meta, splits)  # the replay
    decode_fp8(QuantizedRows(q.content, _offset_view(q.scale, 1), q.rope), cache, table, lens, meta, splits)
    out = torch.empty(BATCH, S_Q, H_Q, 512, dtype=torch.bfloat16)
    with pytest.raises(SnapmlaError, match="^out: data must start on a 16-byte boundary"):
        decode_fp8(q, cache, table, lens, meta, splits, out=_offset_view(out, 2))


# Two steps whose work lists have the same shape ([2, 1, 4] at 16 rows) and different split merges:
# two one-page requests (no split: no fold, no combine) and an empty request next to a 512-token one
# (two splits: merged in the kernel or as a cluster; the combine writes the empty request).
REWRITE_LENGTHS = ([64, 64], [0, 512])


def _rewrite_case():
    cache = torch.zeros(2 * 8, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    table = torch.arange(2 * 8, dtype=torch.int32).view(2, 8)
    lens = [torch.tensor(x, dtype=torch.int32) for x in REWRITE_LENGTHS]
    return cache, table, lens


def _combines(launches: list) -> list:
    return [args for name, _, args in launches if name == "snapmla_combine"]


def test_a_work_list_rewritten_in_place_drops_its_split_merge(recorder):
    """FlashMLA's CUDA-graph pattern (the static buffer from get_mla_metadata, each step's list
    copied into it): the new contents must not run under the old contents' merge decisions (here:
    no combine, so request 1's two partials would stay unmerged and request 0 unwritten)."""
    cache, table, (lens1, lens2) = _rewrite_case()
    q = _q8()
    meta, splits = get_mla_metadata(lens1, S_Q * H_Q, 1)
    meta2, splits2 = get_mla_metadata(lens2, S_Q * H_Q, 1)
    assert meta.shape == meta2.shape and not torch.equal(meta, meta2)
    decode_fp8(q, cache, table, lens1, meta, splits)
    assert not _combines(recorder.launches)  # the planned contents: nothing to merge
    meta.copy_(meta2)
    splits.copy_(splits2)
    recorder.launches.clear()
    decode_fp8(q, cache, table, lens2, meta, splits)
    (decode_args,) = [args for name, _, args in recorder.launches if name != "snapmla_combine"]
    (combine_args,) = _combines(recorder.launches)
    assert combine_args[-1] == 0  # folded_up_to 0: the combine merges every split request
    assert decode_args[-2:] == [0, 0]  # no fold counters, fold limit 0: every split writes its partial
    recorder.launches.clear()
    decode_fp8(q, cache, table, lens2, meta, splits)  # the rebuilt plan is replayed, not rebuilt
    assert len(_combines(recorder.launches)) == 1 and len(recorder.launches) == 2


def test_a_partial_write_or_another_num_splits_drops_the_merge_too(recorder):
    cache, table, (_, lens2) = _rewrite_case()
    q = _q8()
    meta, splits = get_mla_metadata(lens2, S_Q * H_Q, 1)
    _, other_splits = get_mla_metadata(lens2, S_Q * H_Q, 1)
    plan = decode.metadata_plan(meta)
    assert plan is not None and plan.fold_for(meta, splits, S_Q * H_Q) is plan.fold is not None
    assert plan.fold_for(meta, other_splits, S_Q * H_Q) is None  # not the list's own counts
    splits[1:] = splits[1:].clone()  # a slice assignment (same values): a write all the same
    assert plan.fold_for(meta, splits, S_Q * H_Q) is None
    meta2, splits2 = get_mla_metadata(lens2, S_Q * H_Q, 1)
    decode_fp8(q, cache, table, lens2, meta2, splits2)
    recorder.launches.clear()
    meta2[0, 0, 1] = meta2[0, 0, 1]
    decode_fp8(q, cache, table, lens2, meta2, splits2)
    assert _combines(recorder.launches)[-1][-1] == 0


def test_work_lists_made_in_inference_mode_still_notice_a_rewrite():
    """Engines run under torch.inference_mode, whose tensors have no version counter: the work
    list is made as a normal tensor, whose in-place writes are counted even in inference mode."""
    _, _, (lens1, lens2) = _rewrite_case()
    with torch.inference_mode():
        meta, splits = get_mla_metadata(lens2, S_Q * H_Q, 1)
        assert not meta.is_inference() and not splits.is_inference()
        plan = decode.metadata_plan(meta)
        assert plan is not None and plan.fold_for(meta, splits, S_Q * H_Q) is not None
        new_meta, new_splits = get_mla_metadata(lens1, S_Q * H_Q, 1)
        meta.copy_(new_meta)
        splits.copy_(new_splits)
        assert plan.fold_for(meta, splits, S_Q * H_Q) is None


def test_a_graph_work_list_keeps_its_merge_across_updates():
    """GraphWorkList rewrites its tensors every step by design; its merge is right for any
    contents, so an update must not drop it."""
    from snapmla_cli.ops.graph_work_list import GraphWorkList

    _, _, (lens1, lens2) = _rewrite_case()
    work = GraphWorkList(2, S_Q * H_Q, "cpu", max_context=512)
    plan = decode.metadata_plan(work.metadata)
    assert plan is not None and plan.stamp is None
    for lens in (lens1, lens2):
        work.update(lens)
        assert plan.fold_for(work.metadata, work.num_splits, S_Q * H_Q) is plan.fold is not None


@pytest.fixture
def checks_on():
    from snapmla_cli.ops.finite import GPU_CHECKS, set_gpu_checks

    was = GPU_CHECKS.on
    set_gpu_checks(True)
    yield
    set_gpu_checks(was)


def test_the_checks_switch_refuses_a_work_list_planned_for_other_lengths(recorder, checks_on):
    """The kernels trust the work list: planned for 2,560 tokens and called with 1, the wgmma
    kernels masked with negative token counts (the BF16 one wrote outside its shared memory and
    killed the context on an H100). With the checks on, one line names the list, on the first
    call and on a replay; the list of the call's own lengths runs."""
    cache = torch.zeros(2 * 40, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    table = torch.arange(2 * 40, dtype=torch.int32).view(2, 40)
    planned = torch.tensor([2560, 700], dtype=torch.int32)
    actual = torch.tensor([1, 700], dtype=torch.int32)
    q = _q8()
    meta, splits = get_mla_metadata(planned, S_Q * H_Q, 1)
    decode_fp8(q, cache, table, planned, meta, splits)  # (its plan is stored: the next call replays)
    recorder.launches.clear()
    for _ in range(2):
        with pytest.raises(SnapmlaError, match=re.escape("tile_scheduler_metadata: request 0 has ")
                           + ".*" + re.escape("but cache_seqlens[0] = 1 reads blocks [0, 1) (pass the lengths")):
            decode_fp8(q, cache, table, actual, meta, splits)
    bf16_cache = torch.zeros(2 * 40, PAGE_SIZE, 1, D_QK, dtype=torch.bfloat16)
    with pytest.raises(SnapmlaError, match="tile_scheduler_metadata: request 0 has"):
        decode_bf16(torch.zeros(BATCH, S_Q, H_Q, D_QK, dtype=torch.bfloat16), bf16_cache, table, actual, meta, splits)
    assert not recorder.launches
    own_meta, own_splits = get_mla_metadata(actual, S_Q * H_Q, 1)
    decode_fp8(q, cache, table, actual, own_meta, own_splits)
    assert recorder.launches


@pytest.mark.parametrize("lengths", [[0, 64, 512, 700], [1], [0, 0], [5000] * 6, [40000, 3, 0, 129]])
def test_the_work_list_check_takes_every_list_the_planner_makes(lengths):
    from snapmla_cli.ops.decode_config import balanced
    from snapmla_cli.ops.graph_work_list import GraphWorkList
    from snapmla_cli.ops.schedule import check_work_list

    lens = torch.tensor(lengths, dtype=torch.int32)
    for rows in (16, 64, 128):
        check_work_list(*get_mla_metadata(lens, rows, 1), lengths)
        columns = balanced(heuristic_config(rows, True)).with_sms(5)
        check_work_list(*get_mla_metadata(lens, rows, 1, config=columns), lengths)
        work = GraphWorkList(len(lengths), rows, "cpu")
        check_work_list(*work.update(lens), lengths)


def test_the_work_list_check_names_what_is_wrong():
    from snapmla_cli.ops.schedule import check_work_list

    lengths = [0, 512, 700]
    meta, splits = get_mla_metadata(torch.tensor(lengths, dtype=torch.int32), S_Q * H_Q, 1)
    items = meta.reshape(-1, 4)
    assert (items[:, 3] >= 0).any()  # a split request: its partial slots are checked too
    with pytest.raises(SnapmlaError, match="num_splits: expected cumulative split counts from 0"):
        check_work_list(meta, splits + 1, lengths)
    swapped = meta.clone()
    split_rows = (swapped.reshape(-1, 4)[:, 3] >= 0).nonzero().flatten()
    first, second = split_rows[0].item(), split_rows[1].item()
    swapped.reshape(-1, 4)[[first, second], 3] = swapped.reshape(-1, 4)[[second, first], 3]
    with pytest.raises(SnapmlaError, match=r"num_splits: request \d has 2 splits with partial slots"):
        check_work_list(swapped, splits, lengths)
    gap = meta.clone()
    gap.reshape(-1, 4)[first, 2] -= 1  # a split that stops a block short
    with pytest.raises(SnapmlaError, match="with a gap or an overlap|cache_seqlens"):
        check_work_list(gap, splits, lengths)
    foreign = meta.clone()
    foreign.reshape(-1, 4)[first, 0] = 7
    with pytest.raises(SnapmlaError, match=r"tile_scheduler_metadata: item \(7, "):
        check_work_list(foreign, splits, lengths)


def test_a_batch_of_no_requests_launches_nothing_with_any_work_list(recorder):
    """b 0: no decode item and nothing to merge, also for a copied list (no recorded plan), whose
    combine grid would have had no CTA: an invalid launch on a GPU."""
    cache = torch.zeros(4, PAGE_SIZE, FP8_TOKEN_BYTES, dtype=torch.uint8)
    table = torch.zeros(0, 1, dtype=torch.int32)
    lens = torch.zeros(0, dtype=torch.int32)
    q = QuantizedRows(torch.zeros(0, S_Q, H_Q, 512, dtype=torch.uint8), torch.ones(0, S_Q, H_Q),
                      torch.zeros(0, S_Q, H_Q, 64, dtype=torch.bfloat16))
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    for work in ((meta, splits), (meta.clone(), splits.clone())):
        out, lse = decode_fp8(q, cache, table, lens, *work)
        assert out.shape == (0, S_Q, H_Q, 512) and lse.shape == (0, H_Q, S_Q)
    assert not recorder.launches


def test_a_work_list_of_a_larger_batch_is_refused(recorder):
    """num_splits[:b + 1] of a list planned for more requests passes every shape check, but its
    items name requests past the call's batch, whose q, table and out rows the kernels would
    read and write out of bounds: refused, for get_mla_metadata's and GraphWorkList's lists."""
    from snapmla_cli.ops.graph_work_list import GraphWorkList

    cache, table, lens = _paged()
    q = _q8()
    wide = torch.full((2 * BATCH,), CTX, dtype=torch.int32)
    meta, splits = get_mla_metadata(wide, S_Q * H_Q, 1)
    work = GraphWorkList(2 * BATCH, S_Q * H_Q, "cpu")
    work.update(wide)
    for m, n in ((meta, splits), (work.metadata, work.num_splits)):
        with pytest.raises(SnapmlaError, match=f"tile_scheduler_metadata: planned for {2 * BATCH} requests, "
                                               f"the call has {BATCH}"):
            decode_fp8(q, cache, table, lens, m, n[:BATCH + 1])
    assert not recorder.launches


def test_the_fp8_dtype_is_named_as_passed(recorder):
    _, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    wrong = torch.zeros(4, PAGE_SIZE, D_QK, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(SnapmlaError, match=r"got float8_e4m3fn \[4, 64, 576\]"):
        decode_fp8(_q8(), wrong, table, lens, meta, splits)


def test_the_checks_switch_refuses_a_cache_of_another_fp8_encoding(recorder, checks_on):
    """DeepSeek-V3.2's fp8_ds_mla cache has SnapMLA's 656 bytes a token and other contents (more
    scales in the pad bytes, RoPE not pre-scaled): every shape check passes. The pad bytes tell."""
    cache, table, lens = _paged()
    cache[:, :, 512:516] = torch.tensor([1.0], dtype=torch.float32).view(torch.uint8)  # scale 1.0
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode_fp8(_q8(), cache, table, lens, meta, splits)  # zero pads: SnapMLA's encoding
    cache[int(table[1, 3]), 7, 516:528] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32).view(torch.uint8)
    recorder.launches.clear()
    with pytest.raises(SnapmlaError, match=r"k_cache: request 1 reads token 199 with nonzero pad bytes 516\.\.527"):
        decode_fp8(_q8(), cache, table, lens, meta, splits)
    assert not recorder.launches


def test_the_decode_kernel_goes_through_its_prepared_launch_with_one_split_buffer(recorder, monkeypatch):
    """Where the driver has ``cuLaunchKernelEx``, the decode kernel is launched through a plain
    prepared launch built once per plan (CuPy's launch converts every argument each call); the
    split rows' O / L and lse share one allocation, lse right after the O / L rows."""
    prepared_calls: list[tuple[int, list]] = []
    built: list[tuple] = []

    def prepare_plain(kernel, grid, block, shared_mem):
        built.append((kernel.name, grid, block, shared_mem))
        return lambda stream, args: prepared_calls.append((stream, list(args)))

    monkeypatch.setattr(decode_launch, "prepare_plain", prepare_plain)
    monkeypatch.setattr(decode_launch, "current_raw_stream", lambda index: 0x5151)
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    for seed in (0, 1):
        decode_fp8(_q8(seed), cache, table, lens, meta, splits)
    assert len(built) == 1, "the prepared launch was built more than once"
    assert len(prepared_calls) == 2 and all(stream == 0x5151 for stream, _ in prepared_calls)
    assert [name for name, _, _ in recorder.launches] == ["snapmla_combine"] * 2  # no CuPy decode launch
    plan = next(iter(decode_launch._PLANS.values()))
    _, args = prepared_calls[1]
    places = meta.shape[0] * meta.shape[1]
    assert args[11] - args[10] == plan.partial_lse_offset == places * S_Q * H_Q * 512 * 4
    assert plan.partial_floats == places * S_Q * H_Q * 513
    _, _, combine_args = recorder.launches[1]
    assert combine_args[:2] == args[10:12]  # the combine reads the same two buffers


@pytest.fixture
def q_quant_launches(monkeypatch):
    """The Q-quant kernel's launches (prep's handle stands in: the tests run on the CPU)."""
    from snapmla_cli.ops import prep

    calls: list[tuple] = []
    monkeypatch.setattr(prep, "_QUANTIZE_Q",
                        types.SimpleNamespace(launch=lambda index, grid, block, args: calls.append(tuple(args))))
    return calls


def _bf16_q(seed: int = 0) -> torch.Tensor:
    return torch.randn(BATCH, S_Q, H_Q, D_QK, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_flash_mla_fp8_replays_q_quant_and_decode_from_one_workspace(recorder, q_quant_launches):
    """flash_mla_with_kvcache on an FP8 cache: the first call runs quantize_q and decode_fp8 with
    every check; a later one replays one fused plan: the Q-quant kernel writes Q's three parts
    into a workspace, the decode kernel reads them there and writes its split rows right after
    them, and the combine reads those."""
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode.flash_mla_with_kvcache(_bf16_q(0), cache, table, lens, 512, meta, splits)
    assert not q_quant_launches  # (the first call quantized on the CPU: quantize_q's reference path)
    built, launched = recorder.kernels_built, len(recorder.launches)
    q = _bf16_q(1)
    out, lse = decode.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, splits)
    assert recorder.kernels_built == built
    assert out.shape == (BATCH, S_Q, H_Q, 512) and lse.shape == (BATCH, H_Q, S_Q)
    (q_ptr, content, scale, rope, rows), = q_quant_launches
    rows_count = BATCH * S_Q * H_Q
    assert q_ptr == q.data_ptr() and int(rows) == rows_count
    assert (scale - content, rope - scale) == (rows_count * 512, rows_count * 4)  # (16-byte multiples here)
    (_, _, args), (cname, _, cargs) = recorder.launches[launched:]
    assert cname == "snapmla_combine"
    assert args[:3] == [content, scale, rope]
    assert args[10] == rope + rows_count * 64 * 2  # the split rows follow Q's RoPE
    assert args[8:10] == [out.data_ptr(), lse.data_ptr()]
    assert cargs[:2] == args[10:12]
    fused = [plan for plan in decode_launch.stored_plans() if plan.q_quant is not None]
    assert len(fused) == 1 and len(decode_launch._PLANS) == 2  # the fused plan and decode_fp8's


def test_a_replayed_flash_mla_fp8_call_still_checks_q(recorder, q_quant_launches):
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode.flash_mla_with_kvcache(_bf16_q(), cache, table, lens, 512, meta, splits)
    strided = torch.empty(BATCH, S_Q, H_Q, 2 * D_QK, dtype=torch.bfloat16)[..., :D_QK]
    with pytest.raises(SnapmlaError, match="^q: must be contiguous"):
        decode.flash_mla_with_kvcache(strided, cache, table, lens, 512, meta, splits)
    shifted = torch.empty(BATCH * S_Q * H_Q * D_QK + 1, dtype=torch.bfloat16)[1:].view(BATCH, S_Q, H_Q, D_QK)
    with pytest.raises(SnapmlaError, match="^q: .*16"):
        decode.flash_mla_with_kvcache(shifted, cache, table, lens, 512, meta, splits)
    with pytest.raises(SnapmlaError, match="^q: expected bfloat16"):  # another dtype: another key, the full checks
        decode.flash_mla_with_kvcache(_bf16_q().float(), cache, table, lens, 512, meta, splits)
    assert not q_quant_launches


def test_flash_mla_fp8_with_the_checks_switch_takes_the_checked_path(recorder, q_quant_launches, checks_on,
                                                                      monkeypatch):
    """With the checks switch on, every call runs quantize_q and decode_fp8 with their checks
    (the NaN checks read Q's quantized rows): no fused plan is stored or replayed."""
    checked: list[str] = []
    monkeypatch.setattr(decode, "_check_quantized_finite", lambda q: checked.append("q"))
    monkeypatch.setattr(decode, "_check_table_reads", lambda *args: checked.append("table"))
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    for seed in (0, 1, 2):
        decode.flash_mla_with_kvcache(_bf16_q(seed), cache, table, lens, 512, meta, splits)
    assert checked == ["q", "table"] * 3 and not q_quant_launches
    assert not any(plan.q_quant is not None for plan in decode_launch.stored_plans())


def test_the_fused_plan_of_a_freed_work_list_is_dropped(recorder, q_quant_launches):
    cache, table, lens = _paged()
    for _ in range(4):
        meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
        decode.flash_mla_with_kvcache(_bf16_q(), cache, table, lens, 512, meta, splits)
        decode.flash_mla_with_kvcache(_bf16_q(), cache, table, lens, 512, meta, splits)
        del meta, splits
    assert len(q_quant_launches) == 4
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    decode.flash_mla_with_kvcache(_bf16_q(), cache, table, lens, 512, meta, splits)  # a first call drops them
    assert len(decode_launch._PLANS) == 2 and all(plan.metadata() is meta for plan in decode_launch.stored_plans())


def test_clear_cache_drops_the_plans_holding_the_databases_answer(recorder, monkeypatch):
    """A plan keeps the configuration the tuning database gave when it was made (a work list
    snapmla did not build: an engine's static copy). The README says a process picks up a new
    database after `clear_cache()`; the replay kept launching the old kernel."""
    from snapmla_cli.ops.decode_config import FP8_MMA_SYNC
    from snapmla_cli.tuning import lookup

    answer = {"config": heuristic_config(S_Q * H_Q, True)}  # the wgmma kernel
    monkeypatch.setattr(lookup, "lookup_decode_config", lambda **kwargs: answer["config"])
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    static_meta, static_splits = meta.clone(), splits.clone()  # no recorded plan: the database decides
    q = _q8()
    decode_fp8(q, cache, table, lens, static_meta, static_splits)
    assert recorder.launches[-2][0] == "snapmla_decode_fp8_wgmma"
    answer["config"] = heuristic_config(S_Q * H_Q, True, FP8_MMA_SYNC)
    lookup.clear_cache()
    recorder.launches.clear()
    decode_fp8(q, cache, table, lens, static_meta, static_splits)
    assert recorder.launches[0][0] == "snapmla_decode_fp8"


def test_a_replay_refuses_what_a_first_call_refuses_for_the_flags(recorder):
    """``1 == True``: a plan made for ``causal=True`` (or ``softmax_scale=1``) was replayed for
    ``causal=1`` (``softmax_scale=True``), which a first call refuses."""
    cache, table, lens = _paged()
    meta, splits = get_mla_metadata(lens, S_Q * H_Q, 1)
    q = _q8()
    decode_fp8(q, cache, table, lens, meta, splits, causal=True)
    with pytest.raises(SnapmlaError, match="causal: expected True or False"):
        decode_fp8(q, cache, table, lens, meta, splits, causal=1)
    decode_fp8(q, cache, table, lens, meta, splits, softmax_scale=1)
    with pytest.raises(SnapmlaError, match="softmax_scale"):
        decode_fp8(q, cache, table, lens, meta, splits, softmax_scale=True)


def test_dropping_freed_plans_tolerates_another_thread_taking_the_last_key(monkeypatch):
    """Between the loop's test and its pop another thread could take the last freed key:
    `IndexError: pop from empty list` out of a decode call."""

    class RacedList(list):
        def __bool__(self) -> bool:  # the test sees a key, then another thread takes it
            return True

    monkeypatch.setattr(decode_launch, "_FREED_KEYS", RacedList())
    decode_launch._drop_freed()  # returns instead of raising

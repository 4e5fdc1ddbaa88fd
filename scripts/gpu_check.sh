#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, verify on the GPU, the tuner, the benchmarks.
# Usage (device machine, repo root): bash scripts/gpu_check.sh [precompile|tests|verify|probe|tune|ship|ship-small|ship-b1|ship16-small|ship16|ship16-hN|ship16-retune|ship32|ship32-rest|ship64|ship64-rest|ship64-b1|ab|ab-small|smallwork|retune-stale|stale|ab32-rest|ab-pipe|cluster|cluster16|ring|tail|race|clocks|voff|rate|host|steploop|ctatimes|stalls|memory|bench|prep|decode|steady|bench-kimi|info|burst|gap|handover ...]
# With no argument everything but `ship*` / `ab*` / `rate` / `host` / `handover` / `steploop` / `ctatimes` / `clocks` / `stalls` / `memory` / `steady` runs (`ship`: re-tune the shipped database's
# FP8 entries of every bucket of the decode issues' sweep (b 64), replacing the stored ones (--force), about 4-5
# minutes; the other entries stay; `ship-small`: add FP8 entries for batches 4 and 16 (16k, 128k), between
# the shipped 1, 8 and 64; `ship16-small`: the same for BF16; `ship-b1`: FP8 entries for batch 1
# (16k, 128k), the buckets already current skipped (the tuner resumes by default); `ship16-hN`:
# the BF16 entries of h_q N only, replacing the stored ones (--force: after a BF16 kernel change),
# 33-36 s each on a warm machine; `ship16-retune`: re-tune the BF16 entries of h_q 64 / 128 that
# were timed against another default (--resume skips the current ones); `ship16`:
# add the BF16 entries of the same buckets; `ship32`: re-tune the FP8 b 64 entries of 16 and 32 rows (h16 s1 / s2,
# h32 s1) after a change of those kernels, replacing the stored ones; `ship32-rest`: the same at the other batches;
# the new file lands in $OUT).
# `ab`: the database's entries against the heuristic at boost clocks, both formats (scripts/ab_tuning.py);
# `ab-small`: the same for FP8 at batches 1, 4, 8 and 16 (16k, 128k); `smallwork`: the heuristic's small-work
# rule against 64 / 32 / 16-row tiles and the b 1 16k entries it made stale re-tuned; `retune-stale`: the b 1 / b 4 16k
# entries timed against the old default re-tuned, then their A/B; `stale`: `snapmla tune --stale`
# into tuning_db/ for at most STALE_S seconds (resumes next call); `ab32-rest`: ship32-rest's buckets; `ab-pipe`: the QK_DEPTH and
# PV_FRAG_AHEAD switches against the build before them at 16-32 rows, b 64, and their phase traces; `rate`: the tensor cores' rate at the
# decode kernel's wgmma shapes (scripts/wgmma_rate.py); `host`: the host's cost of eager decode calls
# (scripts/host_cost.py); `steploop`: an eager 61-layer decode loop with the metadata planned per
# step from GPU or host lengths, quantize_q + decode_fp8 per layer, then flash_mla_with_kvcache (scripts/step_loop.py); `ctatimes`: a 16k call's fixed cost phase by phase,
# CTA by CTA (scripts/cta_times.py, the CTAs' rows saved in $OUT); `stalls`: Nsight Compute's warp-state
# sampling of one 16k call at 16, 32 and 64 rows, per instruction (scripts/stall_ledger.py; reports in $OUT);
# `memory`: Nsight Compute's memory workload of a 16k call at 16 and 32 rows and of a read-only stream;
# `clocks`: the SM clock of the 64-row tiles at burst clocks (phase traces of h64 s1, h128 s1 / s2, 128k;
# then NVML's clock, power and clock-event reasons during 3 s of replays, scripts/clock_reasons.py);
# `bench-kimi`: `snapmla bench --model kimi-k2` at burst clocks (16k, 64k); `info`: `snapmla info --json` and its summary; `burst`: the spread of a whole bench step timed at burst clocks, one window vs idle rounds (scripts/burst_spread.py); `gap`: the 64k FP8 steps of that script re-allocated and re-run in two processes;
# `cluster`, `cluster16`: the cluster merge's GPU tests and its A/B, FP8 / BF16 (scripts/ab_cluster_fold.py);
# `tail`, `voff`: the rows = M and V^T-offset build switches' GPU tests and A/Bs; `race`: racecheck with
# each hazard named; `ship64`, `ship64-rest`, `ship64-b1`: re-tune the FP8 entries of 64+ rows at b 64 / the other
# batches / b 1 16k.
# Full logs land in $OUT; a short summary prints last.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-/tmp/snapmla_out}"; mkdir -p "$OUT"
steps="${*:-precompile tests verify probe tune bench prep decode}"
snap() { python3 -m snapmla_cli.cli.app "$@"; }
SHAPES="--heads 16,32,64,128 --mtp 1,2"   # the decode issues' head counts and query tokens
SWEEP_CTX="16k,32k,64k,128k"
# snapmla tune into the shipped database (tuning_db/): LOG.log and the new file land in $OUT,
# the last LINES lines print
tune_db() {
  local log="$1" lines="$2"; shift 2
  snap tune "$@" --db-dir tuning_db 2>&1 | tee "$OUT/$log.log" | tail -"$lines"
  cp tuning_db/*.yaml "$OUT/" 2>/dev/null
}
# Nsight Compute on the second decode call of one 16k shape (b 64): ncu_decode HEADS MTP NCU-OPTIONS...
ncu_decode() {
  local heads="$1" mtp="$2"; shift 2
  ncu --clock-control none -k regex:snapmla_decode_fp8_wgmma --launch-skip 1 -c 1 "$@" \
      python3 scripts/profile_decode.py --heads "$heads" --mtp "$mtp" --ctx 16384
}
# compute-sanitizer racecheck on the default paths with each hazard's threads and addresses, one run per
# seed (scripts/sanitize_decode.py prints each case after its kernels: a report belongs to the case below
# it); the whole report lands in $OUT/race.log, its summary lines print
race_default() {
  for seed in "$@"; do
    echo "-- racecheck default seed $seed"
    compute-sanitizer --tool racecheck --racecheck-report hazard python3 scripts/sanitize_decode.py default "$seed" \
      2>&1 | tee -a "$OUT/race.log" | grep -E "rel_l2|SUMMARY" | cut -c1-160
  done
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for step in $steps; do
  echo "== $step"
  case "$step" in
    precompile) python3 scripts/precompile.py 2>&1 | tail -3 ;;
    tests)  python3 -m pytest -q -m gpu --continue-on-collection-errors tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -4 ;;
    verify) snap verify --ctx 32k --fp8-kernel default,v2,v3,v3-alt,v3-rows-m,v3-vt --json "$OUT/verify.json" 2>&1 \
              | tee "$OUT/verify.log" | tail -40 ;;
    probe)  for shape in "16 1 32768 4" "128 2 32768 2"; do python3 scripts/probe_precision.py $shape; done 2>&1 \
              | tee "$OUT/probe_precision.log" | grep -v '^$' ;;
    tune)   tune_db tune 20 $SHAPES --batch 64 --ctx 32k --format fp8 --budget 8s ;;
    ship)   tune_db tune_ship 40 $SHAPES --batch 64 --ctx $SWEEP_CTX --format fp8 --budget 8s --force ;;
    ship-small) tune_db tune_ship_small 40 $SHAPES --batch 4,16 --ctx 16k,128k --format fp8 --budget 6s ;;
    ship-b1) # resumes: the buckets already current are skipped (the H100's run of the forty-fourth
            # session stopped after 11 of the 16)
            tune_db tune_ship_b1 24 $SHAPES --batch 1 --ctx 16k,128k --format fp8 --budget 5s ;;
    ship16-small) tune_db tune_ship16_small 40 $SHAPES --batch 4,16 --ctx 16k,128k --format bf16 --budget 4s ;;
    ship16) tune_db tune_ship16 40 $SHAPES --batch 64 --ctx $SWEEP_CTX --format bf16 --budget 4s ;;
    ship16-retune)
            tune_db tune_ship16_retune_small 30 --heads 64,128 --mtp 1,2 --batch 1,4,8,16 --ctx 16k,128k --format bf16 \
              --budget 4s --resume
            tune_db tune_ship16_retune_b64 20 --heads 64,128 --mtp 1,2 --batch 64 --ctx $SWEEP_CTX --format bf16 \
              --budget 4s --resume ;;
    ship16-h*) tune_db "tune_$step" 12 --heads "${step#ship16-h}" --mtp 1,2 --batch 64 --ctx $SWEEP_CTX --format bf16 \
              --budget 8s --force ;;
    ship32) tune_db tune_ship32_h16 16 --heads 16 --mtp 1,2 --batch 64 --ctx $SWEEP_CTX --format fp8 --budget 6s --force
            tune_db tune_ship32_h32 10 --heads 32 --mtp 1 --batch 64 --ctx $SWEEP_CTX --format fp8 --budget 6s --force ;;
    ship32-rest) # the FP8 entries of 16-32 rows outside b 64 (b 1, 4, 8, 16 at 16k / 128k, b 128 at 32k / 128k),
            # replacing the stored ones, which were timed on the kernels before the paired PVs, the RoPE ring and V_OFFSETS
            tune_db tune_ship32_small_h16 34 --heads 16 --mtp 1,2 --batch 1,4,8,16 --ctx 16k,128k --format fp8 --budget 4s --force
            tune_db tune_ship32_small_h32 18 --heads 32 --mtp 1 --batch 1,4,8,16 --ctx 16k,128k --format fp8 --budget 4s --force
            tune_db tune_ship32_b128 14 --heads 16 --mtp 1,2 --batch 128 --ctx 32k,128k --format fp8 --budget 4s --force
            tune_db tune_ship32_b128_h32 10 --heads 32 --mtp 1 --batch 128 --ctx 32k,128k --format fp8 --budget 4s --force ;;
    ship64) # re-tune the FP8 b 64 entries of 64+ rows (h32 s2, h64, h128) after a rows = M kernel change, replacing the
            # stored ones
            tune_db tune_ship64 20 --heads 64,128 --mtp 1,2 --batch 64 --ctx $SWEEP_CTX --format fp8 --budget 6s --force
            tune_db tune_ship64_h32 8 --heads 32 --mtp 2 --batch 64 --ctx $SWEEP_CTX --format fp8 --budget 6s --force ;;
    ship64-rest) # the other FP8 entries of 64+ rows (b 4, 8, 16 at 16k / 128k, b 1 at 128k, b 128 at 32k / 128k),
            # replacing the stored ones (after a rows = M kernel change; b 1 16k: ship64-b1, whose 6 s budget reaches the
            # alternate-pages tiles that 4 s did not)
            tune_db tune_ship64_small 40 --heads 64,128 --mtp 1,2 --batch 4,8,16 --ctx 16k,128k --format fp8 --budget 4s --force
            tune_db tune_ship64_small_h32 10 --heads 32 --mtp 2 --batch 4,8,16 --ctx 16k,128k --format fp8 --budget 4s --force
            tune_db tune_ship64_b1_128k 12 --heads 32,64,128 --mtp 2 --batch 1 --ctx 128k --format fp8 --budget 4s --force
            tune_db tune_ship64_b1_128k_s1 8 --heads 64,128 --mtp 1 --batch 1 --ctx 128k --format fp8 --budget 4s --force
            tune_db tune_ship64_b128 14 --heads 32,64,128 --mtp 2 --batch 128 --ctx 32k,128k --format fp8 --budget 4s --force
            tune_db tune_ship64_b128_s1 10 --heads 64,128 --mtp 1 --batch 128 --ctx 32k,128k --format fp8 --budget 4s --force ;;
    ship64-b1) # re-tune the FP8 b 1 16k entries of 64+ rows (after a rows = M kernel change: four of them held
            # alternate pages, WG_MODE 3), replacing the stored ones
            tune_db tune_ship64_b1 14 --heads 64,128 --mtp 1,2 --batch 1 --ctx 16k --format fp8 --budget 6s --force
            tune_db tune_ship64_b1_h32 6 --heads 32 --mtp 2 --batch 1 --ctx 16k --format fp8 --budget 6s --force ;;
    ab)     for fmt in fp8 bf16; do python3 scripts/ab_tuning.py --format "$fmt" --rounds 3; done 2>&1 \
              | tee "$OUT/ab_tuning.log" | grep -v '^$' ;;
    ab-small) for b in 1 4 8 16; do python3 scripts/ab_tuning.py --format fp8 --batch "$b" --ctx 16384,131072 --rounds 3; done \
              2>&1 | tee "$OUT/ab_tuning_small.log" | grep -v '^$' ;;
    smallwork) # the FP8 heuristic's small-work rule against 64 / 32 / 16-row tiles (scripts/ab_small_work.py), then the
            # FP8 b 1 16k entries whose default it changed re-tuned (the tuner's resume skips the current ones), then
            # the b 1 entries against the new heuristic
            python3 scripts/ab_small_work.py 2>&1 | tee "$OUT/ab_small_work.log" | tail -30
            tune_db tune_small_work 12 --heads 32,64,128 --mtp 1,2 --batch 1 --ctx 16k --format fp8 --budget 5s
            python3 scripts/ab_tuning.py --format fp8 --batch 1 --ctx 16384,131072 --rounds 3 2>&1 \
              | tee "$OUT/ab_tuning_b1.log" | grep -v '^$' ;;
    retune-stale) # the FP8 b 1 / b 4 16k entries timed against the rows-only default before the small-work rule
            # (the tuner's resume re-tunes exactly those: an entry whose default differs from today's is not current),
            # then the b 1 and b 4 entries against the heuristic
            tune_db tune_retune_stale 24 --heads 32,64,128 --mtp 1,2 --batch 1,4 --ctx 16k --format fp8 --budget 5s
            for b in 1 4; do python3 scripts/ab_tuning.py --format fp8 --batch "$b" --ctx 16384,131072 --rounds 3; done \
              2>&1 | tee "$OUT/ab_tuning_retune.log" | grep -v '^$' ;;
    stale)  # re-time the shipped database's stale entries for this GPU (`snapmla tune --stale`, both formats, the
            # urgent ones first, each bucket's stored configuration right after the default), stopped by SIGINT after
            # STALE_S seconds (default 420) so that it fits one call: the tuner keeps the buckets it finished and the
            # next call resumes with the rest; STALE_BUDGET per bucket (default 3s: 5.1 s a bucket on an H100, the H200's 172 in about 15 min)
            timeout -s INT "${STALE_S:-420}" python3 -m snapmla_cli.cli.app tune --stale --budget "${STALE_BUDGET:-3s}" \
              --db-dir tuning_db \
              > "$OUT/tune_stale.log" 2>&1; echo "tune --stale: rc $?"; tail -30 "$OUT/tune_stale.log"
            cp tuning_db/*.yaml "$OUT/" 2>/dev/null ;;
    ab32-rest) # ship32-rest's entries against the heuristic (the buckets whose entry differs from it)
            { for b in 1 4 8 16; do python3 scripts/ab_tuning.py --format fp8 --heads 16,32 --mtp 1 --batch "$b" \
                --ctx 16384,131072 --rounds 3; python3 scripts/ab_tuning.py --format fp8 --heads 16 --mtp 2 --batch "$b" \
                --ctx 16384,131072 --rounds 3; done
              python3 scripts/ab_tuning.py --format fp8 --heads 16,32 --mtp 1 --batch 128 --ctx 32768,131072 --rounds 3
              python3 scripts/ab_tuning.py --format fp8 --heads 16 --mtp 2 --batch 128 --ctx 32768,131072 --rounds 3
            } 2>&1 | tee "$OUT/ab_tuning_32_rest.log" | grep -v '^$' ;;
    ab-pipe) { python3 scripts/ab_defines.py --a QK_DEPTH=2,PV_FRAG_AHEAD=0 --b QK_DEPTH=3,PV_FRAG_AHEAD=0 \
                  --b QK_DEPTH=2,PV_FRAG_AHEAD=1 --b QK_DEPTH=3,PV_FRAG_AHEAD=1 \
                  --formats fp8 --shapes 16:1,32:1,16:2 --ctx 16384,65536 --rounds 3
                for d in QK_DEPTH=2,PV_FRAG_AHEAD=0 QK_DEPTH=2,PV_FRAG_AHEAD=1 QK_DEPTH=3,PV_FRAG_AHEAD=0 \
                         QK_DEPTH=3,PV_FRAG_AHEAD=1; do
                  python3 scripts/trace_decode.py --heads 32 --mtp 1 --ctx 32768 --define "$d" | tail -2; done; } 2>&1 | tee "$OUT/ab_pipe.log" | grep -v '^$' ;;
    ring)   # a page's RoPE tile and scales in a ring of their own (ROPE_RING, the 32-row default): its GPU
            # tests, then the shipped path against it without the ring and with two slots, b 64 (scripts/ab_configs.py)
            { python3 -m pytest -q -m gpu tests/gpu/test_decode.py -k "rr or ring or v3-alt" 2>&1 | tail -3
              python3 scripts/ab_configs.py --b rope_ring=0 --b stages=5,rope_ring=2 --shapes 32:1,16:2 \
                --ctx 16384,32768,131072 --rounds 3; } 2>&1 | tee "$OUT/ring.log" | grep -v '^$' ;;
    tail)   # rows = M with a partial page's tail zeroed in shared memory (TAIL_ZERO, no V^T byte masks in PV),
            # a whole page's softmax without per-token tests (ROWS_M_WHOLE) and the V^T fragments addressed from
            # one offset a page (V_OFFSETS): their GPU tests, racecheck on the default
            # paths (`race`), then the shipped build against each switch off at 64-256 rows, b 64 (scripts/ab_defines.py)
            { python3 -m pytest -q -m gpu tests/gpu/test_decode.py -k "TAIL_ZERO or ROWS_M_WHOLE or V_OFFSETS or rows_m_switches or rows-m" 2>&1 | tail -3
              race_default 503 504
              python3 scripts/ab_defines.py --b TAIL_ZERO=0 --b ROWS_M_WHOLE=0 --b V_OFFSETS=0 \
                --b TAIL_ZERO=0,ROWS_M_WHOLE=0,V_OFFSETS=0 --shapes 64:1,128:1,128:2 --formats fp8 \
                --ctx 16384,131072 --rounds 3; } 2>&1 \
              | tee "$OUT/tail.log" | grep -v '^$' ;;
    race)   race_default 503 504 ;;
    clocks) # the SM clock at burst clocks of a 64-row tile that streams every page from HBM (h64 s1) against
            # tiles that share their pages through L2 (h128 s1 / s2), 128k: the phase trace after the
            # benchmarks' idle pause and warm-up (the 8% of docs/DESIGN.md, twenty-ninth session)
            for shape in "64 1" "128 1" "128 2"; do set -- $shape
              echo "-- h$1 s$2"; python3 scripts/trace_decode.py --heads "$1" --mtp "$2" --ctx 131072 --clocks burst | tail -2
            done 2>&1 | tee "$OUT/clocks.log"
            # NVML's SM clock, power and clock-event reasons while each shape replays for 3 s
            python3 scripts/clock_reasons.py 2>&1 | tee "$OUT/clock_reasons.log" ;;
    voff)   # V_OFFSETS at 16-32 rows (the alternate pages' paired and single PVs): its GPU tests, then the shipped
            # build against it off, b 64 (scripts/ab_defines.py)
            { python3 -m pytest -q -m gpu tests/gpu/test_decode.py -k "V_OFFSETS or rows_m_switches" 2>&1 | tail -3
              python3 scripts/ab_defines.py --b V_OFFSETS=0 --shapes 16:1,32:1,16:2 --formats fp8 \
                --ctx 16384,131072 --rounds 3; } 2>&1 | tee "$OUT/voff.log" | grep -v '^$' ;;
    memory) # Nsight Compute's memory workload (DRAM, L2) of one 16k call at 16 and 32 rows and of a 2 GiB
            # read-only stream (a float32 sum); the details pages land in $OUT
            for shape in "16 1" "32 1"; do set -- $shape
              ncu_decode "$1" "$2" --section SpeedOfLight --section MemoryWorkloadAnalysis \
                  --section MemoryWorkloadAnalysis_Tables --csv --page details > "$OUT/memory_h$1s$2.csv" 2>&1
            done
            # (a device copy is a memcpy, not a kernel Nsight Compute profiles: a read-only sum streams instead)
            ncu --clock-control none -k regex:reduce -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
                --csv --page details python3 -c \
                "import torch; a = torch.ones(1 << 29, device='cuda'); print(float(a.sum()))" > "$OUT/memory_stream.csv" 2>&1
            grep -h -E "Throughput|Hit Rate|Bandwidth|Duration" "$OUT"/memory_*.csv | cut -c1-220 | tail -60 ;;
    cluster) # the cluster merge (ops/cluster_fold.py): the split-merge GPU tests, then its A/B against the
            # merge through the global partials at b 64, every shape, 16k / 32k / 128k
            python3 -m pytest -q -m gpu tests/gpu/test_split_fold_gpu.py 2>&1 | tee "$OUT/cluster_tests.log" | tail -4
            python3 scripts/ab_cluster_fold.py --ctx 16384,32768,131072 2>&1 | tee "$OUT/ab_cluster.log" | tail -24 ;;
    cluster16) # the BF16 baseline's cluster merge: the split-merge GPU tests, its A/B at 16k
            python3 -m pytest -q -m gpu tests/gpu/test_split_fold_gpu.py 2>&1 | tee "$OUT/cluster_tests.log" | tail -4
            python3 scripts/ab_cluster_fold.py --ctx 16384 --shapes 16:1,32:1,32:2,64:1 --formats bf16 2>&1 \
              | tee "$OUT/ab_cluster16.log" | tail -8 ;;
    host)   python3 scripts/host_cost.py --profile-dir "$OUT" 2>&1 | tee "$OUT/host_cost.log" | tail -20 ;;
    steploop) { python3 scripts/step_loop.py; python3 scripts/step_loop.py --flash-mla; } 2>&1 \
              | tee "$OUT/step_loop.log" | tail -16 ;;
    ctatimes) python3 scripts/cta_times.py --heads 16,32,64 --mtp 1,2 --ctx 16384 --raw-dir "$OUT" 2>&1 \
              | tee "$OUT/cta_times.log" | grep '^cta_times' ;;
    handover) # a hand-over between the two CTAs of a cluster: barrier, 0 / 4 / 16 KB one way
            python3 scripts/cluster_handover.py --json "$OUT/cluster_handover.json" 2>&1 \
              | tee "$OUT/cluster_handover.log" | tail -16 ;;
    rate)   python3 scripts/wgmma_rate.py --json "$OUT/wgmma_rate.json" 2>&1 | tee "$OUT/wgmma_rate.log" | tail -24 ;;
    bench)  snap bench --ctx 16k,64k --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -24 ;;
    burst)  python3 scripts/burst_spread.py 2>&1 | tee "$OUT/burst_spread.log" | tail -20 ;;
    gap)    # the 64k FP8 Kimi-K2 steps (b 13, b 24) twice each per process, in two processes: does a step's
            # time move between allocations or between processes (the 12% of the fiftieth session)?
            for i in 1 2; do python3 scripts/burst_spread.py --cases fp8:13:65536,fp8:13:65536,fp8:24:65536,fp8:24:65536 \
              --repeats 2; done 2>&1 | tee "$OUT/gap.log" | grep -v '^$' ;;
    info)   snap info --json "$OUT/info.json" > "$OUT/info.log" 2>&1; tail -3 "$OUT/info.log"
            python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print('info --json:', g['name'], g['sm_count'], 'SMs', 'kernels' if g['runs_kernels'] else 'no kernels', len(t['entries']), 'entries', sum(e['stale'] is not None for e in t['entries']), 'stale') for g, t in zip(d['gpus'], d['tuning']['gpus'])]" "$OUT/info.json" ;;
    bench-kimi) snap bench --model kimi-k2 --ctx 16k,64k --clocks burst --json "$OUT/bench_kimi.json" 2>&1 \
              | tee "$OUT/bench_kimi.log" | tail -24 ;;
    prep)   python3 scripts/bench_prep.py --json "$OUT/bench_prep.json" 2>&1 | tee "$OUT/bench_prep.log" | tail -14 ;;
    decode) python3 scripts/bench_decode.py --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.log" | tail -34 ;;
    steady) python3 scripts/bench_decode.py --clocks steady --json "$OUT/bench_decode_steady.json" 2>&1 \
              | tee "$OUT/bench_decode_steady.log" | tail -34 ;;
    stalls) # (the reports are dropped once exported: the device returns at most eight files)
            for shape in "16 1" "32 1" "64 1"; do
              set -- $shape; rep="$OUT/stalls_h$1s$2"
              ncu_decode "$1" "$2" --section SourceCounters --section WarpStateStats --section SpeedOfLight \
                  -f -o "$rep" >> "$OUT/stalls_ncu.log" 2>&1
              ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2>> "$OUT/stalls_ncu.log"
              ncu -i "$rep.ncu-rep" --page details --csv > "$rep.details.csv" 2>> "$OUT/stalls_ncu.log"
              rm -f "$rep.ncu-rep"; python3 scripts/stall_ledger.py "$rep.csv" --top 25 --pages 16384
            done 2>&1 | tee "$OUT/stalls.log" | tail -150 ;;
  esac
done

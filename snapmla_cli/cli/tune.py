"""``snapmla tune``: search the decode kernels' parameters per shape bucket on this GPU and store
the winners in the tuning database (SPEC section 9; docs/DESIGN.md, "Tuning")."""

from __future__ import annotations

import functools
import shlex
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from ..errors import NoGpuError, SnapmlaError
from ..sizes import MAX_BATCH, MAX_QUERY_TOKENS, counted, format_size
from ..tables import figure_table
from .common import console, output_option, progress

if TYPE_CHECKING:  # (the database module imports torch: `snapmla --help` stays quick)
    from rich.progress import Progress, TaskID

    from ..tuning.db import Entry, GpuKey, MergeOutcome
    from ..tuning.space import Bucket, Budget, SearchSpace
    from ..tuning.tuner import BucketResult

# the bucket options' values when none is given (and --stale is not)
DEFAULT_BUCKETS = {"heads": "64", "mtp": "1", "batch": "64", "ctx": "16k,32k,64k,128k", "fmt": "fp8"}


@dataclass(frozen=True)
class BucketOptions:
    """The bucket options as typed (None: not given): --stale takes its buckets from the
    database and refuses explicit ones, the other runs fill in DEFAULT_BUCKETS."""

    heads: str | None
    mtp: str | None
    batch: str | None
    ctx: str | None
    fmt: str | None

    def given(self) -> list[str]:
        return [flag for flag, value in (("--heads", self.heads), ("--mtp", self.mtp), ("--batch", self.batch),
                                         ("--ctx", self.ctx)) if value is not None]

    def text(self, name: str) -> str:
        value = getattr(self, name)
        return DEFAULT_BUCKETS[name] if value is None else value


HELP_BUDGET = ("Per bucket: seconds of checking and timing candidates ('120s', '2m'; the bucket's "
               "setup is not counted) or a number of candidates besides the default ('40').")


def tune_command(
    heads: Annotated[str | None, typer.Option("--heads", help=f"Query heads h_q, e.g. 64 or 16,64,128 [default: {DEFAULT_BUCKETS['heads']}].", show_default=False)] = None,
    mtp: Annotated[str | None, typer.Option("--mtp", help=f"Query tokens per request s_q (2 with MTP), 1..{MAX_QUERY_TOKENS}; list allowed [default: {DEFAULT_BUCKETS['mtp']}].", show_default=False)] = None,
    batch: Annotated[str | None, typer.Option("--batch", help=f"Batch buckets: 64, 1,8,64 or a range 16-128, at most {MAX_BATCH} [default: {DEFAULT_BUCKETS['batch']}].", show_default=False)] = None,
    ctx: Annotated[str | None, typer.Option("--ctx", help=f"Context buckets: 16k,32k,64k,128k or ranges (16k-64k) [default: {DEFAULT_BUCKETS['ctx']}].", show_default=False)] = None,
    fmt: Annotated[str | None, typer.Option("--format", help="Cache format: fp8, bf16 or both [default: fp8; with --stale: both].", show_default=False)] = None,
    budget: Annotated[str, typer.Option("--budget", help=HELP_BUDGET)] = "60s",
    stale: Annotated[bool, typer.Option("--stale", help="Re-time the buckets whose entries for this GPU are stale (timed with other kernel sources or against another default; `snapmla info` marks them) instead of naming buckets.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the search space and exit (no GPU needed).")] = False,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Continue an interrupted run and skip buckets already tuned with these kernel sources against this default.")] = True,
    db_dir: Annotated[Path | None, output_option("--db-dir", folder=True, help="Database folder (default: $SNAPMLA_TUNING_DIR or ~/.config/snapmla/tuning).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Re-time buckets already tuned, store the new result even when the stored entry is faster, and overwrite an unreadable file (dropping malformed entries).")] = False,
) -> None:
    """Tune the decode kernels for this GPU and write the tuning database.

    For each bucket (h_q, s_q, batch range, context range, format) the kernel variants and split
    policies of the search space (as many as --budget allows, the likeliest first) are compiled,
    checked against the reference numerics, and timed as CUDA-graph replays at the boost clock
    (a short window after an idle pause); the fastest is stored next to the heuristic default's
    time."""
    try:
        _tune(BucketOptions(heads, mtp, batch, ctx, fmt), budget, dry_run, resume, db_dir, force, stale)
    except SnapmlaError as exc:
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        again = "run the same command again" if resume else "run it again without --no-resume"
        typer.echo(f"interrupted: measurements so far are kept; {again} to resume", err=True)
        raise typer.Exit(130) from None


def _advance(bar: Progress, task: TaskID, offset: int, desc: str, done: int, total: int) -> None:
    """The tuning bar after ``done`` candidates of the bucket that starts at ``offset``."""
    bar.update(task, completed=offset + done, description=desc)


def _tune(options: BucketOptions, budget: str, dry_run: bool, resume: bool, db_dir: Path | None, force: bool,
          stale: bool) -> None:
    from ..sizes import BATCH_LIMIT_TEXT, MAX_QUERY_HEADS, parse_int_list
    from ..tuning.space import (
        MAX_TUNE_BATCH,
        make_buckets,
        parse_budget,
        parse_formats,
        parse_ranges,
    )

    limit = parse_budget(budget)
    folder, origin = _database_folder(db_dir)
    if stale:
        buckets, commands = _stale_buckets(options, budget, _stale_source(folder))
        command = shlex.join(["snapmla", "tune", "--stale", "--budget", budget])
        if not buckets:
            return
    else:
        heads, mtp, batch, ctx, fmt = (options.text(name) for name in ("heads", "mtp", "batch", "ctx", "fmt"))
        buckets = make_buckets(parse_int_list(heads, "--heads", MAX_QUERY_HEADS),
                               parse_int_list(mtp, "--mtp", MAX_QUERY_TOKENS, example="1,2"),
                               parse_ranges(batch, "--batch", MAX_TUNE_BATCH, BATCH_LIMIT_TEXT), parse_ranges(ctx, "--ctx"),
                               parse_formats(fmt))
        commands = {}
        # (quoted: the entry's command must paste back into a shell, `--ctx "16k, 32k"` too)
        command = shlex.join(["snapmla", "tune", "--heads", heads, "--mtp", mtp, "--batch", batch, "--ctx", ctx,
                              "--format", fmt, "--budget", budget])
    if dry_run:
        _dry_run(buckets, limit, folder)
    else:
        _run(buckets, limit, folder, origin, resume, force, command, commands)


def _stale_buckets(options: BucketOptions, budget: str, folder: Path | None) -> tuple[list[Bucket], dict[str, str]]:
    """--stale: the buckets of this GPU's stale entries (the user's database, then the shipped
    one, as the lookup reads them; given a ``folder``, that folder's alone: :func:`_stale_source`)
    in the formats asked for, and per bucket the command that
    names it (stored in its new entry, so that the entry says how to reproduce it). None stale
    is not an error: it says so, and the run stops there."""
    import torch

    from ..tuning.lookup import device_gpu_key, stale_buckets
    from ..tuning.space import bucket_command, parse_formats

    if options.given():
        raise SnapmlaError(f"--stale takes its buckets from the tuning database; drop {', '.join(options.given())}")
    if not torch.cuda.is_available():
        raise NoGpuError("--stale: no CUDA GPU here, and which entries are stale depends on the GPU")
    gpu = device_gpu_key(torch.cuda.current_device())
    found = stale_buckets(gpu, parse_formats(options.fmt or "both"), folder)
    if not found:
        where = "" if folder is None else f" in {folder}"
        console().print(f"no stale tuning entry{where} applies to {gpu.label()}: nothing to re-time")
    return [b for b, _ in found], {b.id: bucket_command(b, budget) for b, _ in found}


def _stale_source(folder: Path) -> Path | None:
    """Where --stale finds its stale entries when it writes to ``folder``: the lookup's order
    (None: the user's folder, then the shipped one) when ``folder`` is the user's, whose new
    entries shadow the shipped ones; else ``folder``'s own entries (``--db-dir tuning_db``
    refreshes the shipped file, which entries of the user's folder have nothing to do with)."""
    from ..tuning.db import user_dir

    try:
        return None if folder.resolve() == user_dir().resolve() else folder
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return folder


def _database_folder(db_dir: Path | None) -> tuple[Path, str]:
    """(folder, what named it) for the database: ``--db-dir``, else ``$SNAPMLA_TUNING_DIR``,
    else the default. A folder that cannot be used is refused up front, naming where it came
    from: the user who set only the environment variable never typed ``--db-dir``."""
    from ..tuning.db import expand_folder, folder_problem, user_dir, user_dir_origin

    if db_dir is not None:
        folder, origin = expand_folder(db_dir), "--db-dir"
    else:
        folder, origin = user_dir(), user_dir_origin()
    problem = folder_problem(folder)
    if problem:
        raise SnapmlaError(f"{origin}: {folder} cannot be used as the database folder ({problem})")
    return folder, origin


def _make_folder(folder: Path, origin: str) -> None:
    """Create the database folder before any measurement, and write a file in it, so that a
    folder that cannot be made (a dangling symlink, a read-only parent) or written (a read-only
    file system, which `access` does not tell root) fails in one line, not at the first
    candidate's progress file after the precompile."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SnapmlaError(f"{origin}: cannot create the database folder {folder} "
                           f"({exc.strerror or type(exc).__name__})") from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise SnapmlaError(f"{origin}: cannot write in the database folder {folder} "
                           f"({exc.strerror or type(exc).__name__})") from None


# ---------------------------------------------------------------------------------------------
# --dry-run


def _gpu_for_dry_run() -> tuple[GpuKey | None, int]:
    """(GpuKey, SM count) of the current GPU, or (None, default SM count) without one."""
    import torch

    from ..tuning.space import DEFAULT_NUM_SMS

    if not torch.cuda.is_available():
        return None, DEFAULT_NUM_SMS
    from ..tuning.lookup import device_gpu_key

    try:
        key = device_gpu_key(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - a dry run never needs the GPU
        return None, DEFAULT_NUM_SMS
    return key, key.sm_count or DEFAULT_NUM_SMS


def _dry_run(buckets: list[Bucket], limit: Budget, folder: Path) -> None:
    from ..tuning.db import db_filename, entries_for
    from ..tuning.space import config_id, search_space, smem_bytes, split_policies

    out = console()
    gpu, sms = _gpu_for_dry_run()
    where = folder / (db_filename(gpu.name) if gpu else "<GPU name>.yaml")
    gpu_text = gpu.label() if gpu else f"none (split plans assume {sms} SMs)"
    spaces = [search_space(b, sms) for b in buckets]
    shown: set[tuple[str, int]] = set()
    for space in spaces:
        b = space.bucket
        if (b.format, b.rows) in shown:
            continue
        shown.add((b.format, b.rows))
        # the default kernel can differ per bucket of the same rows (the small-work rule):
        # every one of them is marked, the buckets table below says which bucket runs which
        defaults = {s.kernels[0] for s in spaces if (s.bucket.format, s.bucket.rows) == (b.format, b.rows)}
        table = figure_table(f"{b.format} kernel variants for {b.rows} rows (h_q x s_q)",
                             ("kernel", "row groups", "kv split", "stages", "block_n", "CTAs/SM",
                              "smem B", "split policies"))
        for k in space.kernels:
            kid = config_id(k, b.format).split("/")[0]
            table.add_row(kid + (" (default)" if k in defaults else ""),
                          str(k.row_groups), str(getattr(k, "kv_split", "-")) if b.fp8 else "-",
                          str(k.stages), str(k.block_n) if not b.fp8 else "-",
                          str(k.min_ctas_per_sm), str(smem_bytes(k, b.format)),
                          str(len(split_policies(k, space.default.split, b.fp8))))
        out.print(table)
        reasons = Counter(why.rule for _, why in space.pruned)
        if space.pruned:
            out.print(f"pruned {counted(len(space.pruned), 'variant')}: "
                      + "; ".join(f"{n} x {r}" for r, n in sorted(reasons.items())))
    policies = split_policies(spaces[0].default, spaces[0].default.split, spaces[0].bucket.fp8)
    out.print("split policies (target CTAs per SM x waves, bal(anced columns) or auto (the planner's choice "
              "of the two per batch) / min blocks per split): "
              + ", ".join(config_id(replace(spaces[0].default, split=p), spaces[0].bucket.format).split("/", 1)[1]
                          for p in policies))
    table = figure_table("buckets", ("bucket", "timed at", "candidates", "same-plan aliases dropped", "default",
                                     "then (stored entry)"))
    previous = _previous_entries(entries_for(folder, gpu) if gpu else {}, gpu)
    for space in spaces:
        b = space.bucket
        table.add_row(b.label(), f"batch {b.timed_batch} x ctx {format_size(b.timed_context)}",
                      str(len(space.candidates)), str(space.aliases),
                      config_id(space.default, b.format), _prior_text(space, previous.get(b)))
    out.print(table)
    total = sum(len(s.candidates) for s in spaces)
    out.print(f"{counted(len(spaces), 'bucket')}, {counted(total, 'candidate')}; budget {limit}; GPU: {gpu_text}; "
              f"database: {where}")
    if unread := unread_folder_note(folder):
        out.print(unread)


def _previous_entries(in_folder: dict[Bucket, Entry], gpu: GpuKey | None) -> dict[Bucket, Entry]:
    """Per bucket, the entry a run starts from: the one in the folder it writes (``in_folder``,
    read by the caller), else the one the lookup takes for this GPU (the user's, then the shipped
    one); none without a GPU. Each file is read once per run, not once per bucket."""
    from ..tuning.lookup import stored_entries

    if gpu is None:
        return {}
    return stored_entries(gpu) | in_folder


def _prior_text(space: SearchSpace, previous: Entry | None) -> str:
    """What the tuner measures right after the default: the configuration of the bucket's
    stored entry ('-' without one)."""
    from ..tuning.space import config_id, seeded

    if previous is None:
        return "-"
    seeded_space, note = seeded(space, previous.config)
    if seeded_space.prior is not None:
        return config_id(seeded_space.prior, space.bucket.format)
    return "not in the space" if note else "(the default)"


# ---------------------------------------------------------------------------------------------
# the real run


def _run(buckets: list[Bucket], limit: Budget, folder: Path, origin: str, resume: bool, force: bool, command: str,
         commands: dict[str, str] | None = None) -> None:
    """Tune ``buckets`` into ``folder``; each new entry records ``command``, or the bucket's own
    in ``commands`` (--stale)."""
    import torch

    from .. import __version__
    from ..runtime.nvrtc import kernel_dir, product_sources_hash
    from ..tuning.db import db_filename, entries_for, save_entries, sections_to_merge
    from ..tuning.lookup import clear_cache, device_gpu_key
    from ..tuning.measure import GpuMeasurer
    from ..tuning.space import search_space, seeded, settled_at
    from ..tuning.tuner import BucketResult, EntryInfo, PartialStore, Tuner, partial_path

    try:
        measurer = GpuMeasurer()
    except NoGpuError as exc:
        raise NoGpuError(f"{exc}; --dry-run lists the search space without a GPU") from None
    _make_folder(folder, origin)
    gpu = device_gpu_key(measurer.device.index)
    sections_to_merge(folder / db_filename(gpu.name), force)  # refuse a file it would damage now
    kernels = product_sources_hash(kernel_dir())
    out, err = console(), console(stderr=True)
    spaces = [search_space(b, measurer.sm_count) for b in buckets]
    partial = PartialStore(partial_path(folder, gpu, measurer.uuid), gpu, kernels, resume)
    if partial.note:
        err.print(partial.note)
    results: list[BucketResult] = []
    todo = []
    notes: dict[str, list[str]] = {}  # bucket id: what the table says of its re-timing
    in_folder_entries = entries_for(folder, gpu)
    previous_entries = _previous_entries(in_folder_entries, gpu)
    for space in spaces:
        in_folder = in_folder_entries.get(space.bucket)
        stored = in_folder if resume and not force else None
        why = None if stored is None else stored.stale_reason(kernels, space.default)
        if stored is not None and why is None:
            results.append(BucketResult(space.bucket, None, None, [], stored.default_time_us / 1e6,
                                        stored.time_us / 1e6, skipped="already tuned",
                                        entry=stored))
            continue
        said = notes.setdefault(space.bucket.id, [])
        if why is not None:
            said.append(f"re-timed: the stored entry was timed with {why}")
        previous = previous_entries.get(space.bucket)
        if previous is not None:
            space, note = seeded(space, previous.config)
            said += [note] if note else []
        todo.append(space)
    info = EntryInfo(__version__, command, kernels)
    tuner = Tuner(measurer, limit, info, partial=partial)
    t0 = time.monotonic()
    with progress(err) as bar:
        items = [(s.bucket.format, settled_at(c, s.bucket)) for s in todo for c in tuner.likely_candidates(s)]
        task = bar.add_task("compiling kernel variants", total=None)
        measurer.precompile(items, lambda done, total: bar.update(task, completed=done, total=total))
        bar.remove_task(task)
        planned = [tuner.planned(s) for s in todo]
        task = bar.add_task("tuning", total=sum(planned))
        offset = 0
        for space, n in zip(todo, planned):
            tuner.progress = functools.partial(_advance, bar, task, offset)
            tuner.info = replace(info, command=(commands or {}).get(space.bucket.id, command))
            result = tuner.tune(space)
            result.notes[:0] = notes[space.bucket.id] + _prior_note(space, result, previous_entries.get(space.bucket))
            offset += n
            bar.update(task, completed=offset)
            line = _line(result)  # (this run's measurements, whatever the merge keeps)
            if result.entry is not None:
                _, outcomes = save_entries(folder, gpu, [result.entry], force)
                note = merge_note(outcomes[0], result.entry)
                if note:
                    result.notes.append(note)
                if outcomes[0].action == "kept_old" and outcomes[0].previous is not None:
                    # the table shows what the database holds, its times beside its configuration
                    # (this run's best time next to the stored configuration described neither)
                    kept = outcomes[0].previous
                    result.entry, result.default_time_s, result.best_time_s = (
                        kept, kept.default_time_us / 1e6, kept.time_us / 1e6)
            partial.finish(space.bucket.id)
            results.append(result)
            bar.console.print(line)
    clear_cache()
    torch.cuda.empty_cache()
    order = {b: i for i, b in enumerate(buckets)}
    results.sort(key=lambda r: order[r.bucket])
    _render(out, results, gpu, folder, time.monotonic() - t0)


def _prior_note(space: SearchSpace, result: BucketResult, previous: Entry | None) -> list[str]:
    """How the stored configuration, measured right after the default, fares with today's
    kernels next to its stored time: after a kernel change this says whether the former winner
    got slower, which the new entry alone (perhaps another configuration) would not."""
    from ..tuning.space import config_id

    if space.prior is None or previous is None:
        return []
    cid = config_id(space.prior, space.bucket.format)
    m = next((m for m in result.measured if m.cid == cid), None)
    if m is None:  # a budget of no candidates
        return []
    if not m.ok or m.time_s is None:
        return [f"the stored configuration {cid} failed with these kernels ({m.detail})"]
    return [f"the stored configuration {cid}: {m.time_s * 1e6:.1f} us now, {previous.time_us:.1f} us stored"]


# A stored entry faster than this by more than the run-to-run spread of a timing is worth a note
# when --force replaces it (the same configuration re-timed differs by about 1-2%).
FORCED_SLOWER_MARGIN = 0.02


def merge_note(outcome: MergeOutcome, new: Entry) -> str | None:
    """What the database merge did that the user should hear about: the stored entry kept
    because it was faster, or (--force) a clearly faster stored entry replaced by this run's,
    which happens when a small --budget times fewer candidates than the run that stored it
    (docs/PERF.md, twenty-eighth session: b 1 16k, 25.2 us stored over 22.2), or a clearly
    faster stored entry timed with other kernel sources given way (its configuration is named:
    a run with a larger --budget may find it again)."""
    from ..tuning.space import config_id

    old = outcome.previous
    if old is None:
        return None
    if outcome.action == "kept_old":
        return f"kept the stored entry ({old.time_us:.1f} us), faster than this run's; --force to replace it"
    if old.time_us * (1 + FORCED_SLOWER_MARGIN) < new.time_us and old.default_config == new.default_config:
        if old.kernels != new.kernels:
            return (f"replaced a stored entry timed with other kernel sources ({old.time_us:.1f} us, "
                    f"{config_id(old.config, old.bucket.format)}, {old.date}): its time does not describe these kernels")
        return (f"--force replaced a faster stored entry ({old.time_us:.1f} us, {old.candidates} candidates, "
                f"{old.date}) with this run's {new.time_us:.1f} us ({new.candidates} candidates)")
    return None


def _line(r: BucketResult) -> str:
    """One log line per finished bucket (the table comes at the end)."""
    from ..tuning.space import config_id

    if r.entry is None:
        return f"{r.bucket.label()}: nothing stored ({len(r.measured)} measured, {r.failed} failed)"
    return (f"{r.bucket.label()}: default {_us(r.default_time_s)} us, tuned {_us(r.best_time_s)}"
            f" us ({r.speedup:.3f}x) {config_id(r.entry.config, r.bucket.format)}; "
            f"{len(r.measured)} measured, {r.failed} failed; {_phases(r.phase_s, 1)}")


def _phases(phase_s: Mapping[str, float], digits: int) -> str:
    """'2.1 s setup + 3.0 s candidates + 1.6 s confirmation': where a bucket's (or the run's)
    wall time went (--budget counts only the candidates)."""
    return " + ".join(f"{seconds:.{digits}f} s {phase}" for phase, seconds in phase_s.items())


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def _render(out: Console, results: list[BucketResult], gpu: GpuKey, folder: Path, wall: float) -> None:
    from ..tuning.db import db_filename
    from ..tuning.space import config_id

    table = figure_table(f"snapmla tune on {gpu.label()}",
                         ("bucket", "default us", "tuned us", "speed-up", "tuned config", "timed",
                          "failed", "note"))
    for r in results:
        tuned = config_id(r.entry.config, r.bucket.format) if r.entry else "-"
        speed = f"{r.speedup:.3f}x" if r.speedup else "-"
        note = r.skipped or ("not stored: nothing passed the gate" if r.entry is None else "")
        table.add_row(r.bucket.label(), _us(r.default_time_s), _us(r.best_time_s), speed, tuned,
                      str(len(r.measured)), str(r.failed), note)
    out.print(table)
    for r in results:
        for note in r.notes:
            out.print(f"{r.bucket.label()}: {note}")
        for m in r.measured:
            if not m.ok and "wrong result" in m.detail:
                out.print(f"{r.bucket.label()}: {m.cid} failed the gate ({m.detail})")
    totals: Counter[str] = Counter()
    for r in results:
        totals.update(r.phase_s)
    spent = f"; {_phases(totals, 0)}" if totals else ""
    out.print(f"database: {folder / db_filename(gpu.name)} ({wall:.0f} s{spent})")
    if unread := unread_folder_note(folder):
        out.print(unread)


def unread_folder_note(folder: Path) -> str | None:
    """A note when the decode calls do not read ``folder`` (a ``--db-dir`` that is neither the
    user's folder nor the shipped one): the entries just written would otherwise go unused
    without a word, where the issue promises that every later decode call on this GPU uses them."""
    from ..tuning.db import TUNING_DIR_ENV, search_dirs

    dirs = search_dirs()
    try:
        if folder.resolve() in {p.resolve() for _, p in dirs}:
            return None
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return None
    read = " and ".join(str(p) for _, p in dirs)
    return (f"note: the decode calls read the tuning database from {read}, not from {folder}: "
            f"set {TUNING_DIR_ENV}={shlex.quote(str(folder.absolute()))} where they run to use these entries")

"""Run the paper's rows x seeds, read every run's TensorBoard events, and write the comparison.

    python tools/suite.py --rows configs/cpu --seeds 0 1 2 --out runs/suite_cpu [--jobs 2 --threads 1]

A rows folder holds ``base.yaml`` (the shared model, data and trainer settings) and one overlay per row
(``<row>.yaml``). Each run is ``aah fit --config base.yaml --config <row>.yaml --seed_everything <seed>
--model.aah.seed <seed>``, logged to ``<out>/<row>/seed<seed>/``: a seed changes the initialisation and every
policy's own randomness (random windows, the probe's query sample, random grouping, the paper allocator's networks,
the shuffles); the data order and split stay fixed (``data.seed``), so all runs see the same batches. Finished runs
are skipped when the suite is started again, and a run stopped part-way resumes exactly from its last checkpoint
(``--ckpt_path last``), so an interrupted suite loses at most the steps since each run's last checkpoint. Outputs in
``<out>``: ``results.csv`` (one line per run), ``results.md`` (mean +- std over seeds per row, difference to the
baseline row), ``val_loss_vs_acr.png`` and ``val_loss_curves.png`` (validation loss against step per row), and
``positions.md`` (the last validation's loss by position bucket per row).

Arguments after ``--`` go to every run; ``{seed}`` in them is the run's seed, so that each run of a retrofit starts
from its own seed's source: ``-- --model.init_from=runs/recall10/baseline/seed{seed}/checkpoints/last.ckpt``.

``--eval-seq-lens 2048 4096`` also validates each finished run's last checkpoint at those sequence lengths (``aah
validate --data.seq_len L``: RoPE at any length, heads that saw the whole trained context keep the whole context),
logged to ``<run>/eval/seq<L>/``; their losses join the records and ``positions.md``. Rows named
``<family>_acr<target>`` (configs/frontier) are a quality-compute frontier: ``frontier.md`` and ``frontier.png``
compare the families at each target ACR (docs/frontier.md).

This tool runs the runs (commands, processes, resume); reading them back into records and writing the tables and
plots is ``aah_lightning/experiments/``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from aah_lightning.experiments.outputs import write_outputs
from aah_lightning.experiments.protocol import LEARNED
from aah_lightning.experiments.records import (
    checkpoint_dir,
    interrupted_time,
    merged_records,
    position_losses,
    read_scalars,
    recall_accuracies,
    row_policy,
    run_dir,
    summarise,
    task_circuit,
    window_summary,
)


def row_files(rows_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(rows_dir, "*.yaml")))
    return [f for f in files if os.path.basename(f) != "base.yaml"]


def row_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def fit_command(rows_dir: str, row_path: str, seed: int, out: str, extra: list[str]) -> list[str]:
    row, rd = row_name(row_path), run_dir(out, row_name(row_path), seed)
    return [
        sys.executable,
        "-m",
        "aah_lightning",
        "fit",
        "--config",
        os.path.join(rows_dir, "base.yaml"),
        "--config",
        row_path,
        f"--seed_everything={seed}",
        f"--model.aah.seed={seed}",
        f"--trainer.logger.init_args.save_dir={os.path.join(out, row)}",
        f"--trainer.logger.init_args.name=seed{seed}",
        "--trainer.logger.init_args.version=logs",
        f"--checkpoint.dirpath={checkpoint_dir(rd)}",
        "--trainer.enable_progress_bar=false",
        *per_seed(extra, seed),
    ]


def per_seed(extra: list[str], seed: int) -> list[str]:
    """The extra arguments with every ``{seed}`` replaced by the run's seed (a retrofit's source per seed)."""
    return [a.replace("{seed}", str(seed)) for a in extra]


def validate_command(
    rows_dir: str, row_path: str, seed: int, out: str, extra: list[str], seq_len: int, trained_span: bool = False
) -> list[str]:
    """``aah validate`` of the run's last checkpoint at ``seq_len`` tokens, logged to ``<run>/eval/seq<seq_len>``;
    with ``trained_span`` the heads that saw the whole trained context keep that length as a sliding window
    (``model.gpt.full_heads_beyond_trained``), logged to ``<run>/eval/seq<seq_len>_span``."""
    rd = run_dir(out, row_name(row_path), seed)
    name = f"seq{seq_len}_span" if trained_span else f"seq{seq_len}"
    return [
        sys.executable,
        "-m",
        "aah_lightning",
        "validate",
        "--config",
        os.path.join(rows_dir, "base.yaml"),
        "--config",
        row_path,
        f"--seed_everything={seed}",
        f"--model.aah.seed={seed}",
        f"--trainer.logger.init_args.save_dir={os.path.join(rd, 'eval')}",
        f"--trainer.logger.init_args.name={name}",
        "--trainer.logger.init_args.version=logs",
        f"--checkpoint.dirpath={checkpoint_dir(rd)}",
        "--trainer.enable_progress_bar=false",
        *per_seed(extra, seed),
        f"--data.seq_len={seq_len}",
        f"--ckpt_path={os.path.join(checkpoint_dir(rd), 'last.ckpt')}",
        *(["--model.gpt.full_heads_beyond_trained=trained_span"] if trained_span else []),
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", required=True, help="folder with base.yaml and one yaml per row")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*", help="run only these rows")
    p.add_argument("--rerun", action="store_true", help="rerun runs that already finished")
    p.add_argument(
        "--report",
        action="store_true",
        help="run nothing: write the comparison from the runs of these rows and seeds that have finished",
    )
    p.add_argument(
        "--merge",
        nargs="*",
        default=[],
        help="earlier suites' output folders (results.csv, tables.json): their runs of these rows and seeds join the "
        "comparison where this --out has none, and are not run again (rows measured in another session or on another "
        "machine, e.g. docs/frontier_recall10)",
    )
    p.add_argument(
        "--learned-at",
        type=float,
        default=LEARNED,
        help=f"recall tasks: the final recall at which a seed counts as having learned (default {LEARNED}; lower only "
        "for a task whose formed circuit tops out below it, and fix it before the runs)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run (OMP_NUM_THREADS)")
    p.add_argument(
        "--eval-seq-lens",
        type=int,
        nargs="*",
        default=[],
        help="also validate each run's last checkpoint at these sequence lengths (e.g. 2T and 4T)",
    )
    p.add_argument(
        "--eval-trained-span",
        action="store_true",
        help="validate at each --eval-seq-lens length a second time with full heads held to the trained length",
    )
    p.add_argument(
        "extra", nargs=argparse.REMAINDER, help="after --: extra arguments for every aah fit ({seed}: its seed)"
    )
    args = p.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]

    os.makedirs(args.out, exist_ok=True)
    files = [f for f in row_files(args.rows) if not args.only or row_name(f) in args.only]
    rows = [row_name(f) for f in files]
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    # Seed-major: an interrupted suite has every row's first seeds before any row's last ones.
    runs = [(path, seed) for seed in args.seeds for path in files]
    merged = {folder: merged_records(folder, rows, args.seeds) for folder in args.merge}  # read once, used twice
    recorded = {(r["row"], r["seed"]) for more, _ in merged.values() for r in more}

    def measured_elsewhere(path: str, seed: int) -> bool:
        """A --merge folder holds this run and --out has not finished it: it is not run here."""
        done = os.path.join(run_dir(args.out, row_name(path), seed), "done")
        return (row_name(path), seed) in recorded and not os.path.exists(done)

    long_validations = [(n, span) for n in args.eval_seq_lens for span in [False, *([True] * args.eval_trained_span)]]
    if args.dry_run:
        for path, seed in runs:
            if measured_elsewhere(path, seed):
                continue
            print(" ".join(shlex.quote(a) for a in fit_command(args.rows, path, seed, args.out, extra)))
            for n, span in long_validations:
                cmd = validate_command(args.rows, path, seed, args.out, extra, n, span)
                print(" ".join(shlex.quote(a) for a in cmd))
        return
    env = dict(os.environ)
    if args.threads:  # torch reads it at start-up: one setting for every run
        env["OMP_NUM_THREADS"] = str(args.threads)
    started = time.time()
    curves: dict[tuple[str, int], list] = {}  # (row, seed) -> the run's val/loss series, for the curve plot
    heads: dict[tuple[str, int], dict] = {}  # (row, seed) -> the run's final table and per-head ACR over the run

    def run(path: str, seed: int) -> dict:
        rd = run_dir(args.out, row_name(path), seed)
        done = os.path.join(rd, "done")
        if measured_elsewhere(path, seed):
            return None  # its record joins from the --merge folder below
        if args.report and not os.path.exists(done):
            return None  # not run (yet): left out of the comparison
        if args.rerun:
            shutil.rmtree(rd, ignore_errors=True)
        if not os.path.exists(done):
            before = interrupted_time(rd)  # None: no checkpoint to resume from
            resume = before is not None
            if not resume:
                shutil.rmtree(rd, ignore_errors=True)  # nothing worth keeping: start clean
                os.makedirs(rd)
                before = 0.0
            t0 = time.time()
            with open(os.path.join(rd, "started"), "w") as f:
                f.write(f"{t0} {before}\n")
            cmd = fit_command(args.rows, path, seed, args.out, extra)
            if resume:
                cmd += ["--ckpt_path", "last"]  # an exact resume: same batches, same window decisions
            with open(os.path.join(rd, "fit.log"), "a") as log:
                result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            if result.returncode != 0:
                raise RuntimeError(f"{row_name(path)} seed {seed} failed (exit {result.returncode}); see {rd}/fit.log")
            with open(done, "w") as f:
                f.write(f"{before + time.time() - t0:.1f}\n")
        with open(done) as f:
            wall = float(f.read())
        series = read_scalars(os.path.join(rd, "logs"))
        curves[(row_name(path), seed)] = series.get("val/loss", [])
        policy = row_policy(os.path.join(args.rows, "base.yaml"), path)
        record = {"row": row_name(path), "seed": seed, "wall_s": wall, "policy": policy, **summarise(series)}
        record.update(position_losses(series))
        record.update(recall_accuracies(series))
        fields, heads[(row_name(path), seed)] = window_summary(os.path.join(checkpoint_dir(rd), "last.ckpt"))
        record.update(fields)
        for n, span in long_validations:  # the finished run's last checkpoint at other lengths (each done once)
            ed = os.path.join(rd, "eval", f"seq{n}_span" if span else f"seq{n}")
            if not os.path.exists(os.path.join(ed, "done")):
                shutil.rmtree(ed, ignore_errors=True)
                os.makedirs(ed)
                with open(os.path.join(ed, "validate.log"), "w") as log:
                    cmd = validate_command(args.rows, path, seed, args.out, extra, n, span)
                    if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode:
                        raise RuntimeError(f"{row_name(path)} seed {seed}: validation at {n} tokens failed; see {ed}")
                open(os.path.join(ed, "done"), "w").close()
            long, key = read_scalars(ed), f"span{n}" if span else f"seq{n}"
            record[f"{key} val_loss"] = long["val/loss"][-1][1]
            record.update(position_losses(long, f"{key} "))
        print(
            f"{record['row']:>32} seed {seed}: val {record['val_loss']:.4f}  ACR paid {record['acr_mean']:.3f} "
            f"(last {record['acr']:.3f})  heads differ at {record['nonuniform_share']:.0%} of steps  {wall:.0f} s",
            flush=True,
        )
        return record

    # Runs are independent processes; --jobs N runs N at a time (give each --threads of the machine's cores).
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run, path, seed) for path, seed in runs]
        try:
            records = [r for r in (f.result() for f in futures) if r is not None]
        except RuntimeError as e:
            pool.shutdown(cancel_futures=True)
            sys.exit(str(e))
    for folder, (more, more_heads) in merged.items():  # earlier measurements of runs --out does not hold (no curves)
        have = {(r["row"], r["seed"]) for r in records}
        more = [r for r in more if (r["row"], r["seed"]) not in have]
        records += more
        heads.update({k: v for k, v in more_heads.items() if k not in heads and k not in have})
        curves.update({(r["row"], r["seed"]): [] for r in more})
        print(f"merged from {folder}: {len(more)} runs", flush=True)
    records.sort(key=lambda r: (rows.index(r["row"]), r["seed"]))  # the outputs list row by row
    circuit = task_circuit(os.path.join(args.rows, "base.yaml"))
    print(write_outputs(args.out, records, rows, curves, heads, circuit, args.learned_at))
    print(
        f"suite wall time: {time.time() - started:.0f} s (this invocation); "
        f"sum of run times: {sum(r['wall_s'] for r in records):.0f} s"
    )


if __name__ == "__main__":
    main()

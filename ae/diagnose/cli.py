"""`ae-diagnose [LOGS_DIR] [--run TS] [--json] [--goodput] [--tail N] [--dump] [--watch]
[--bundle OUT.tar.gz] [--timeline OUT.png] [--trace OUT.json]`.

Exit status: 0 when the run was read (whatever the verdict), 2 for a user mistake (no such
folder, no run in it, unknown --run), with one message and no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loguru import logger
from rich.console import Console

import logging_cfg
from ae.diagnose.attempts import diagnose_job, render_attempts
from ae.diagnose.bundle import write_bundle
from ae.diagnose.flight_recorder import request_dump
from ae.diagnose.goodput import render_goodput
from ae.diagnose.log_files import DiagnoseError, find_run, resolve_logs_dir, run_of_file
from ae.diagnose.report import render
from ae.diagnose.timeline import build_timeline, draw_timeline
from ae.diagnose.trace import write_trace
from ae.diagnose.watch import watch
from ae.errors import UserError

DEFAULT_LOGS = "runs/ae/logs"  # the logs of the default --output_dir
WIDE = 250


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ae-diagnose",
        description="Name the rank that holds a job back, from the logs of a live or dead run.",
    )
    p.add_argument(
        "logs_dir",
        nargs="?",
        default=DEFAULT_LOGS,
        help=f"a run's logs folder, or its output folder (default: {DEFAULT_LOGS})",
    )
    p.add_argument("--run", metavar="TS", help="the run's timestamp (default: the newest run)")
    p.add_argument("--json", action="store_true", help="print one JSON object (see README)")
    p.add_argument(
        "--goodput",
        action="store_true",
        help="what the job's failures cost: its wall time over all its attempts, split into "
        "training, data wait, checkpoints, validation, recompute, detection, restart, startup",
    )
    p.add_argument(
        "--tail",
        type=int,
        default=0,
        metavar="N",
        help="also show the last N lines of each rank's debug log",
    )
    p.add_argument(
        "--dump",
        action="store_true",
        help="first ask the live ranks of this host to dump their recent collectives",
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="live view of every rank from the heartbeat files (Ctrl-C to stop)",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="S",
        help="--watch: seconds between refreshes (default 2)",
    )
    p.add_argument(
        "--count",
        type=int,
        default=0,
        metavar="N",
        help="--watch: stop after N refreshes (default: until every rank exits)",
    )
    p.add_argument(
        "--bundle",
        type=Path,
        metavar="OUT.tar.gz",
        help="write logs, heartbeats, config, environment and tails for a bug report",
    )
    p.add_argument(
        "--timeline",
        type=Path,
        metavar="OUT.png",
        help="draw every rank's phases over wall time, with stalls, stragglers and the culprit",
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="OUT.json",
        help="the same events as a Chrome trace (Perfetto, chrome://tracing)",
    )
    return p  # fmt: skip


def _one_view(args: argparse.Namespace) -> None:
    """A run of ae-diagnose shows one view: the flags of another are refused by name rather than
    ignored (`--watch --json` printed the live table, and no JSON)."""
    views = [
        ("--watch", args.watch), ("--bundle", args.bundle is not None),
        ("--timeline/--trace", args.timeline is not None or args.trace is not None),
    ]  # fmt: skip
    chosen = [flag for flag, on in views if on]
    report = [flag for flag, on in (("--json", args.json), ("--goodput", args.goodput),
                                    ("--tail", args.tail > 0)) if on]  # fmt: skip
    if len(chosen) > 1 or (chosen and report):
        raise DiagnoseError(
            f"{' and '.join(chosen + report)} are separate views of a run: give one at a time "
            "(the diagnosis takes --json, --goodput and --tail)"
        )
    if args.goodput and args.tail > 0 and not args.json:  # --json holds both
        raise DiagnoseError(
            "--goodput and --tail are separate views of a run: --tail adds the ranks' last log "
            "lines to the table, which --goodput replaces; give one at a time (--json holds both)"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging_cfg.configure_console()
    console = Console(highlight=False)
    if not console.is_terminal:  # piped or redirected: the full table, not 80 columns
        console = Console(highlight=False, width=WIDE)
    try:
        if args.tail < 0 or args.interval <= 0 or args.count < 0:
            raise DiagnoseError("--tail and --count must be >= 0, --interval > 0")
        _one_view(args)
        given = Path(args.logs_dir)
        logs_dir = resolve_logs_dir(given)
        # One of a run's files given (the log a user was reading): that run, unless --run says
        files = find_run(logs_dir, args.run or (run_of_file(given) if given.is_file() else None))
        if args.dump:
            done, silent = request_dump(files)
            quiet = f"; no answer from rank {', '.join(map(str, silent))}" if silent else ""
            logger.info(f"Collectives dumped by rank {', '.join(map(str, done)) or 'none'}{quiet}")
            files = find_run(logs_dir, files.ts)  # the new files
        if args.watch:
            watch(logs_dir, files.ts, console, args.interval, args.count)
        elif args.bundle is not None:
            names = write_bundle(files, args.bundle)
            console.print(f"Bundle of run {files.ts}: {args.bundle} ({len(names)} files)")
        elif args.timeline is not None or args.trace is not None:
            timeline = build_timeline(files)
            for path, write in ((args.timeline, draw_timeline), (args.trace, write_trace)):
                if path is not None:
                    write(timeline, path)
                    console.print(f"Run {files.ts}: {path} ({len(timeline.ranks)} ranks)")
        else:
            doc = diagnose_job(files, args.tail)
            if args.goodput and not args.json:
                render_goodput(doc["goodput"], console)
            elif args.json:
                sys.stdout.write(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
            else:
                render(doc, console)
                render_attempts(doc["attempts"], console)
    except UserError as e:
        logger.error(f"ae-diagnose: {e.render()}")
        return e.exit_code
    return 0

"""The ae-encode job on this node: check everything that can be checked without the model (the
arguments and output names: `ae.job.encode_args`), then torchrun over `ae.cli.encode_rank` (the
ranks: `ae.rank.encode`; one process, the launcher starts itself). No torch here.

What ae-encode does and its flags: `ae/cli/encode.py`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from loguru import logger

from ae.config import RunConfig
from ae.data.shards.spec import expand_shards, is_remote
from ae.errors import UserError
from ae.job.encode_args import EncodeArgs, EncodeArgsError, output_paths, parse_args
from ae.job.encode_outputs import (
    Survey,
    job_outputs,
    read_record,
    remove_leftovers,
    settings_of,
    skipped_outputs,
    survey,
    updated_record,
    write_record,
)
from ae.job.folder_lock import (
    ENCODING,
    RunLock,
    acquire,
    follow,
    unused_run_ts,
)
from ae.job.outcome import report_failure, stop_exit_code
from ae.job.processes import processes_per_node, rank_is_child, run_ranks
from ae.job.topology import Topology, topology
from ae.log_lines import LAUNCHER_LOG_FILE
from ae.run_paths import RunDir

RANK_MODULE = "ae.cli.encode_rank"  # what runs in every rank
CHECK_MODULE = "ae.cli.check_checkpoint"  # the safe loader's verdict on a checkpoint


def check_outputs(
    urls: list[str], outs: list[Path], *, overwrite: bool = False, found: Survey | None = None
) -> None:
    """Refuse outputs that would collide or replace an input shard, and, without `overwrite`,
    files OUT_DIR already holds under an output's name that a run of this command cannot take
    as its own (`found.foreign`: `ae.job.encode_outputs`; without `found`, every such file): a
    dataset of the same shard names (ae-encode into the folder of other shards would replace
    them silently), or an encoding with another checkpoint (its latents and this one's would
    mix)."""
    problems = []
    seen: dict[Path, str] = {}
    inputs, twice = [], []
    for url, out in zip(urls, outs, strict=True):
        if out in seen:
            twice.append(f"{seen[out]} and {url} -> {out}")
        seen[out] = url
        if not is_remote(url) and out.resolve() == Path(url).resolve():
            inputs.append(url)
    if inputs:
        more = f" and {len(inputs) - 1} more" if len(inputs) > 1 else ""
        problems.append(
            f"OUT_DIR: {outs[0].parent} holds the input shards: the outputs would overwrite "
            f"{inputs[0]}{more}; encode into another folder"
        )
    if twice:
        more = f" (and {len(twice) - 1} more pairs)" if len(twice) > 1 else ""
        problems.append(
            f"SPEC: input shards of one file name would both be written to one output: "
            f"{twice[0]}{more}; encode each set into its own folder"
        )
    found = found or survey(urls, outs, None, None)
    if found.foreign and not overwrite and not problems:
        foreign = [outs[i] for i in found.foreign]
        names = ", ".join(out.name for out in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        problems.append(
            f"OUT_DIR: {foreign[0].parent} already holds {len(foreign)} of the {len(outs)} "
            f"output shards ({names}) and {found.why}; encode into another folder, or pass "
            "--overwrite to replace them"
        )
    if problems:
        raise EncodeArgsError("\n".join(problems[:5]))


def check_out_dir_outside_inputs(spec: str, out_dir: Path) -> None:
    """OUT_DIR inside a folder given as SPEC: its latents would be inputs of the next run of
    the same command (and of a training run on that folder)."""
    for part in spec.split("::"):
        folder = Path(part.strip())
        if is_remote(part.strip()) or not folder.is_dir():
            continue
        inside = out_dir.resolve().is_relative_to(folder.resolve())
        if inside and out_dir.resolve() != folder.resolve():  # the same: check_outputs says
            raise EncodeArgsError(
                f"OUT_DIR: {out_dir} is inside the input folder {part.strip()}: its shards would "
                "be inputs of a run of the same command again (and of training on that folder);"
                " encode into a folder outside it"
            )


def make_out_dir(args: EncodeArgs) -> None:
    """OUT_DIR and its logs/, made once everything else is checked (bad input leaves no folder):
    a file in the way or a read-only disk is one message, not torchrun's traceback."""
    try:
        args.logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EncodeArgsError(
            f"OUT_DIR: {args.out_dir} cannot be written ({e.strerror}: {e.filename or args.logs});"
            " encode into a folder you can write"
        ) from None


def claim_out_dir(args: EncodeArgs, topo: Topology, env: dict[str, str]) -> RunLock | None:
    """One job per OUT_DIR, as for training (`ae.job.folder_lock`): the first node's launcher
    takes the folder's lock (a second ae-encode into it, say with another checkpoint, would mix
    its latents with this one's), the others wait until it names their job. Sets the job's run
    TS in `env`. The outputs are checked again under the lock: a job that ended a moment ago
    may have written them."""
    run = RunDir(Path(args.out_dir))
    if not topo.leader:
        env["AE_RUN_TS"] = follow(run, topo.job, kind=ENCODING).run_ts
        return None
    ts = env.get("AE_RUN_TS") or unused_run_ts(run.logs, time.strftime("%Y%m%d_%H%M%S"))
    lock = acquire(run, topo.job, ts, ENCODING)
    env["AE_RUN_TS"] = ts
    return lock


def check_checkpoint(args: EncodeArgs) -> None:
    """A checkpoint the safe loader refuses stops the job before any rank starts (the ranks
    check again). torch is needed to tell: a short process of its own, not this one."""
    if args.trust_checkpoint:
        return
    check = subprocess.run(
        [sys.executable, "-m", CHECK_MODULE, args.ckpt], capture_output=True, text=True
    )
    if check.returncode == UserError.exit_code:
        raise EncodeArgsError(check.stderr.strip())


def launch(argv: list[str]) -> int:
    """The whole encode job on this node, from its arguments to its exit code."""
    with contextlib.ExitStack() as held:  # the folder's lock, once taken, however this ends
        return _launch(argv, held)


def _launch(argv: list[str], held: contextlib.ExitStack) -> int:
    env = dict(os.environ)
    try:
        args = parse_args(argv)
        check_out_dir_outside_inputs(args.spec, Path(args.out_dir))
        urls = expand_shards(args.spec, "SPEC")
        outs = output_paths(urls, Path(args.out_dir))
        check_outputs(urls, outs, overwrite=True)  # the names alone, before the checkpoint
        check_checkpoint(args)
        settings = settings_of(Path(args.ckpt), args.field, args.dtype, args.keep)
        found = survey(urls, outs, read_record(Path(args.out_dir)), settings)
        check_outputs(urls, outs, overwrite=args.overwrite, found=found)
        run = RunConfig(devices=args.devices, accelerator=args.accelerator)
        topo = topology(run)
        nproc, problems = processes_per_node(run, topo)
        if problems:
            raise EncodeArgsError("\n".join(problems))
        make_out_dir(args)
        lock = claim_out_dir(args, topo, env)
        if lock is not None:
            held.callback(lock.release)
        # Again under the lock: a job that ended a moment ago may have written outputs.
        record = read_record(Path(args.out_dir))
        found = survey(urls, outs, record, settings)
        check_outputs(urls, outs, overwrite=args.overwrite, found=found)
    except UserError as e:
        logger.error(e.render())
        return e.exit_code
    if lock is not None:
        # Before any rank starts: a job stopped from here on leaves the record of what it wrote.
        write_record(Path(args.out_dir), updated_record(record, settings, job_outputs(urls, outs)))
        remove_leftovers(outs)
    todo = len(urls) if args.overwrite else len(found.todo(len(urls)))
    skipped = len(urls) - todo
    resumed = (
        f" ({skipped} of {len(urls)} complete in {args.out_dir} from an earlier run of this "
        "command: skipped; --overwrite encodes them again)"
        if skipped
        else ""
    )
    if not todo:
        logger.info(
            f"Nothing to encode: all {len(urls)} output shards are complete in {args.out_dir} "
            "from an earlier run of this command; --overwrite encodes them again"
        )
        return 0
    ts = env["AE_RUN_TS"]
    launcher_log = Path(args.logs) / LAUNCHER_LOG_FILE.format(ts=ts)
    torchrun = "" if rank_is_child(topo, nproc) else (
        f"\n  launcher  : {launcher_log} (torchrun's own output)")  # fmt: skip
    logger.info(
        f"Encoding {todo} shards{resumed} on {nproc} process(es) per node into {args.out_dir}"
        f"\n  summary   : {args.logs}/train_{ts}.log"
        f"\n  rank logs : {args.logs}/debug_rank*_{ts}.log{torchrun}"
    )
    rc, stopped = run_ranks(
        RANK_MODULE, args.debug, [*argv, f"--devices={nproc}"], nproc=nproc,
        topo=topo, env=env, launcher_log=launcher_log, keep_fds=lock.descriptors() if lock else (),
        on_stop="every rank stops now; the output shards it finished stay in place",
    )  # fmt: skip
    if stopped is not None:
        logger.warning(
            f"Stopped by {stopped.name}: the output shards finished are in place; run the same "
            "command again to encode the rest (complete shards are skipped)"
        )
        return stop_exit_code(stopped)
    if rc == 0:
        logger.info(f"Done. Shards in {args.out_dir}/, logs in {args.logs}/ (run {ts})")
        return rc
    # The ranks' own words, not torchrun's: the verdict, or a user error's one message (exit 2)
    code = report_failure(Path(args.logs), ts, rc, job="Encoding")
    done = skipped_outputs(urls, outs, Path(args.out_dir), overwrite=False)
    if code != UserError.exit_code and done:
        logger.info(
            f"{len(done)} of {len(urls)} output shards are complete; once the cause is fixed, "
            "run the same command again to encode the rest (complete shards are skipped)"
        )
    return code

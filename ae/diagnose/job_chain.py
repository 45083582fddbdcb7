"""The attempts of a job that restarted (`--max_restarts`): each attempt is a run of its own (its
own TS), and the first line of a restarted attempt's train log is the launcher's RESTART line,
which names the run before it. Following those lines both ways from any attempt gives them all."""

from __future__ import annotations

from ae.diagnose.log_files import RunFiles
from ae.log_lines import RECORD_PATTERN, RESTART

HEAD_BYTES = 64 * 1024  # the RESTART line is among a train log's first lines


def restart_line(run: RunFiles) -> str | None:
    """The RESTART message that opens this run's train log, or None."""
    if not run.train_logs:
        return None
    with open(run.train_logs[0], "rb") as f:
        head = f.read(HEAD_BYTES).decode(errors="replace")
    for line in head.splitlines():
        m = RECORD_PATTERN.match(line)
        if m and RESTART.parse(m["message"]):
            return m["message"]
    return None


def restart_lines(runs: dict[str, RunFiles]) -> dict[str, str]:
    """{run TS: the RESTART line that opens its train log} of the runs that have one."""
    return {ts: line for ts, run in runs.items() if (line := restart_line(run))}


def job_chain(ts: str, runs: dict[str, RunFiles], lines: dict[str, str]) -> list[str]:
    """The run TSs of the attempts of the job that run `ts` belongs to, oldest first, following
    the RESTART lines (`lines`, from `restart_lines`) both ways."""
    previous = {t: RESTART.parse(line)["previous"] for t, line in lines.items()}  # type: ignore[index]
    following = {prev: t for t, prev in previous.items()}
    chain = [ts]
    while (prev := previous.get(chain[0])) in runs and prev not in chain:
        chain.insert(0, prev)
    while (nxt := following.get(chain[-1])) is not None and nxt not in chain:
        chain.append(nxt)
    return chain

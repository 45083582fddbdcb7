"""A pytest plugin (tests/conftest.py loads it): every test of the run, slowest first, written
to `.pytest_durations.txt` in the rootdir when the session ends, passed or failed; .ci/run prints
its head. Each test's seconds are its setup + call + teardown, and beside them the CPU seconds it
used, its own and its finished subprocesses' (launchers, ranks): a test with far less CPU than
wall time mostly waits, and can run beside others (`pytest -n`). Under pytest-xdist the workers
measure and the controller, which gets every report, writes the file."""

from __future__ import annotations

import resource
import time
from collections.abc import Generator
from pathlib import Path

import pytest

FILE_NAME = ".pytest_durations.txt"
_CPU_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class SlowestTests:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.outcome: dict[str, str] = {}
        self.started = time.monotonic()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        item.stash[_CPU_START] = _cpu_seconds()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if _CPU_START in item.stash:
            report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_START]))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = report.nodeid
        self.seconds[node] = self.seconds.get(node, 0.0) + report.duration
        for key, value in report.user_properties:
            if key == "cpu_s":
                self.cpu[node] = max(self.cpu.get(node, 0.0), value)
        if report.failed or report.skipped or report.when == "call":
            self.outcome.setdefault(node, report.outcome)
            if report.failed:
                self.outcome[node] = "failed"

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
            return
        wall = time.monotonic() - self.started
        slowest = sorted(self.seconds, key=self.seconds.__getitem__, reverse=True)
        lines = [
            f"{len(self.seconds)} tests in {wall:.0f} s (exit {int(exitstatus)}); the tests' own "
            f"{sum(self.seconds.values()):.0f} s, cpu {sum(self.cpu.values()):.0f} s; slowest "
            "first (s = setup + call + teardown; cpu = its processes'):"
        ]
        for node in slowest:
            cpu = f"{self.cpu[node]:7.1f}" if node in self.cpu else "      ?"
            outcome = self.outcome.get(node, "?")
            lines.append(f"{self.seconds[node]:7.1f} s  cpu {cpu} s  {outcome:7s}  {node}")
        Path(session.config.rootpath, FILE_NAME).write_text("\n".join(lines) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SlowestTests(), "ae_slowest_tests")

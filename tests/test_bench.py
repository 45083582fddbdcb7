"""Every benchmark keeps running: its `--quick` mode, started as a user starts it (`python -m
bench.<name> --quick`, a subprocess), exits 0 and writes its record with the keys its readers
expect. Timings are never asserted. A new bench in bench/ must be listed here (and have a quick
mode), or the listing test fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from bench.peer_data import extra_installed, peer_versions
from tests.support.runs import ROOT, TWO_HOSTS

# bench module -> (its record's name, keys of the record besides bench/quick/machine)
BENCHES: dict[str, tuple[str, set[str]]] = {
    "count_bench": ("count_bench_all", {"count", "startup", "load"}),
    "diagnose_bench": ("diagnose_bench", {"ranks", "debug_logs_mb", "median_s", "culprits"}),
    "flight_recorder": (
        "flight_recorder",
        {"overhead", "us_per_collective", "dump_entries", "dump_s"},
    ),
    "goodput": ("goodput", {"steps", "kill_after_s", "kills", "hosts", "runs"}),
    "gpu_proof": (
        "gpu_proof",
        {"device", "data", "hand", "throughput", "sync_check", "targets", "correctness", "faults"},
    ),
    "gpu_throughput": ("gpu_throughput", {"device", "batch_size", "samples", "rows"}),
    "input_pipeline": ("input_pipeline", {"batch_size", "rows", "jpg_decode_ms", "targets"}),
    "loss_terms_bench": ("loss_terms", {"model", "batch_size", "rows", "validation_ms"}),
    "memory": ("memory", {"epochs", "by_shards"}),
    "peers": ("peers", {"versions", "batch_size", "datasets", "rows"}),
    "models_bench": ("models_bench_both", {"epochs", "data", "quality", "comparison_grid"}),
    "plan_bench": ("plan_bench", {"plan", "cases", "ratios"}),
    "preflight_bench": (
        "preflight_bench",
        {"launcher_startup_s", "launcher_preflight_s", "rank_preflight_s", "heartbeat_resources_s"},
    ),
    "rank_series_bench": ("rank_series", {"rows"}),
    "startup": ("startup", {"rows", "difference_s"}),
    "straggler_soak": ("straggler_soak", {"soak", "cost_us", "per_step_us", "overhead_pct"}),
    "trainer_overhead": ("trainer_overhead", {"steps", "timed_steps", "repeats", "rows"}),
    "watchdog_overhead": (
        "watchdog_overhead",
        {"overhead_percent", "control_percent", "whole_runs_overhead_percent"},
    ),
}
# Modules of bench/ that are not benchmarks: shared helpers and data.
HELPERS = {
    *("__init__", "common", "peer_data", "real_images", "synthetic_logs", "trainer_variants"),
    *("lockstep", "trainer_sides", "peer_readers", "two_hosts"),
    # bench.gpu_proof's modules
    *(
        "gpu_correctness",
        "gpu_data",
        "gpu_hand",
        "gpu_parts",
        "gpu_probe",
        "gpu_runner",
        "gpu_timing",
    ),
}


def test_every_bench_is_listed() -> None:
    modules = {p.stem for p in ROOT.joinpath("bench").glob("*.py")} - HELPERS
    assert modules == set(BENCHES), "list a new bench (and give it --quick) in BENCHES"


# Benches whose own process needs no torch (they launch runs, or read logs), and benches that
# use torch but not Lightning nor torchmetrics: importing torch costs a process ~2.5 s of CPU,
# Lightning ~2 s more, and the suite runs every quick mode.
NO_TORCH = ("count_bench", "diagnose_bench", "flight_recorder", "goodput", "gpu_proof", "memory")
NO_TORCH += ("models_bench", "plan_bench", "startup")
NO_LIGHTNING = ("gpu_throughput", "input_pipeline", "loss_terms_bench")


def test_a_bench_process_imports_only_what_it_uses() -> None:
    """Importing the benches above and writing a record's machine leaves torch unimported (where
    no GPU device file is: there torch names the GPU); the others import no Lightning."""
    code = (
        "import sys, glob, importlib, bench.common as c\n"
        f"for b in {NO_TORCH!r}: importlib.import_module('bench.' + b)\n"
        "c.machine()\n"
        "gpu = any(glob.glob(p) for p in c.GPU_DEVICE_FILES)\n"
        "print(gpu or 'torch' not in sys.modules)\n"
        f"for b in {NO_LIGHTNING!r}: importlib.import_module('bench.' + b)\n"
        "print(not {'lightning', 'torchmetrics'} & set(sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr[-3000:]


# bench.goodput runs two namespace hosts: one at a time with the two-host tests.
RESOURCE_GROUPS = {"goodput": TWO_HOSTS}


@pytest.mark.slow
@pytest.mark.parametrize(
    "bench", [pytest.param(b, marks=RESOURCE_GROUPS.get(b, ())) for b in sorted(BENCHES)]
)
def test_quick_mode_runs_and_writes_its_record(bench: str, tmp_path: Path) -> None:
    name, keys = BENCHES[bench]
    if bench == "peers" and not extra_installed(peer_versions()):  # the bench prints `skipped:`
        pytest.skip("the peers extra is not installed (docs/BENCHMARKS.md: pip install '.[peers]')")
    env = {**os.environ, "AE_BENCH_RESULTS": str(tmp_path)}  # not the full runs' records
    # A few seconds to a minute each (6-8 min in all at a load of 5-9 on 2 cores, trainer_overhead
    # aside); a launch of the real launcher is most of a quick mode's cost (~8 s of CPU a rank),
    # so they launch once where they can, one rank on one thread; and a bench's own process
    # imports torch (~2.5 s of CPU) only where it uses it.
    out = subprocess.run(
        [sys.executable, "-m", f"bench.{bench}", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads((tmp_path / f"{name}_quick.json").read_text())
    assert record["bench"] == name and record["quick"] is True
    # the machine, as torch says it (bench.common reads the version from the package's metadata
    # where importing torch only for the record would cost its process ~2.5 s of CPU)
    assert record["machine"]["torch"] == version("torch"), record["machine"]
    assert {"host", "cpus", "python", "gpu", "date"} <= set(record["machine"])
    assert keys <= set(record), sorted(keys - set(record))
    if bench == "gpu_proof":  # every part ran; the stall (in the throughput launch) was seen
        assert not record["errors"], record["errors"]
        assert record["throughput"] and record["sync_check"], record["skipped"]
        assert record["faults"]["gpu_stall"]["stall_lines"], record["faults"]["gpu_stall"]
    if bench == "trainer_overhead":  # the three figures, for 1 and 2 processes
        assert [row["processes"] for row in record["rows"]] == [1, 2]
        for row in record["rows"]:
            for clock in ("wall", "cpu"):
                ratios = {"ae_vs_manual", "lightning_vs_manual", "ae_vs_lightning"}
                assert all(row[clock][k] > 0 for k in ratios), row[clock]

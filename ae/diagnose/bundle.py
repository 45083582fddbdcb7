"""`ae-diagnose --bundle OUT.tar.gz`: everything a bug report needs, in one file.

Under `ae-bundle-<TS>/`: `logs/` (every file of the run: train, debug and native logs with their
rotations, heartbeats), `diagnosis.json` and `diagnosis.txt`, `config.yaml` (the resolved config
from the train log), `environment.txt` (this machine: Python, packages, distributed/CUDA/SLURM
environment variables, `nvidia-smi`), and `tails/rank<N>.log` (the last lines of each rank).
The environment is the one `ae-diagnose` runs in; each rank's own is in its debug log header.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from rich.console import Console

from ae.diagnose.evidence import read_run
from ae.diagnose.log_files import DiagnoseError, RunFiles
from ae.diagnose.logscan import LogBytes
from ae.diagnose.report import render, to_json
from ae.diagnose.verdict import judge

TAIL_LINES = 100
PACKAGES = ("torch", "lightning", "webdataset", "loguru", "rich", "numpy", "psutil", "pyyaml",
            "pillow")  # fmt: skip
_ENV_NAMES = re.compile(
    r"^(CUDA_|NCCL_|TORCH|PYTORCH_|MASTER_|SLURM_|OMP_|AE_|NVIDIA_|GLOO_)|"
    r"^(WORLD_SIZE|RANK|LOCAL_RANK|LOCAL_WORLD_SIZE|NNODES|NODE_RANK|LD_LIBRARY_PATH|PYTHONPATH)$"
)
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY$", re.I)


def environment() -> str:
    lines = [
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
        f"host: {platform.node()}",
        f"platform: {platform.platform()}",
        f"python: {sys.version.split()[0]} ({sys.executable})",
        "packages:",
    ]
    for name in PACKAGES:
        try:
            lines.append(f"  {name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"  {name}: not installed")
    lines.append("environment:")
    for key in sorted(k for k in os.environ if _ENV_NAMES.search(k)):
        value = "<redacted>" if _SECRET.search(key) else os.environ[key]
        lines.append(f"  {key}={value}")
    lines.append("nvidia-smi:")
    if shutil.which("nvidia-smi") is None:
        lines.append("  not found")
    else:
        try:
            out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
            lines += [f"  {line}" for line in (out.stdout or out.stderr).splitlines()]
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"  failed: {e}")
    return "\n".join(lines) + "\n"


def _add_text(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    tar.addfile(info, io.BytesIO(data))


def write_bundle(files: RunFiles, out: Path) -> list[str]:
    """Write the tarball; returns the names of its members."""
    if not out.parent.is_dir():
        raise DiagnoseError(f"no such folder for the bundle: {out.parent}")
    run = read_run(files)
    doc = to_json(run, judge(run))
    text = io.StringIO()
    render(doc, Console(file=text, width=160, color_system=None, force_terminal=False))
    root = f"ae-bundle-{files.ts}"
    with tarfile.open(out, "w:gz") as tar:
        for path in files.all_files():
            tar.add(path, arcname=f"{root}/logs/{path.name}")
        _add_text(tar, f"{root}/diagnosis.json", json.dumps(doc, indent=1) + "\n")
        _add_text(tar, f"{root}/diagnosis.txt", text.getvalue())
        if run.train.config is not None:
            _add_text(tar, f"{root}/config.yaml", run.train.config + "\n")
        _add_text(tar, f"{root}/environment.txt", environment())
        for rank, paths in sorted(files.debug_logs.items()):
            tail = LogBytes.read(paths[-1]).tail(TAIL_LINES)
            _add_text(tar, f"{root}/tails/rank{rank}.log", "".join(e.text + "\n" for e in tail))
        return tar.getnames()

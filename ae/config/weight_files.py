"""Where the LPIPS weights are (`--perceptual_weights`) and the FID Inception's (`--fid_weights`),
resolved without torch, so that the launcher stops a run whose files are missing before any
worker starts.

`--perceptual_weights=auto` (the default) looks in torch's own cache, `$TORCH_HOME/hub/
checkpoints` (torch.hub's rule: `$TORCH_HOME`, else `$XDG_CACHE_HOME/torch`, else
`~/.cache/torch`), where `torchvision.models.vgg16(weights=...)` leaves its file; the heads may
also come from an installed `lpips` package (found, never imported: it imports torchvision).
`--perceptual_weights=DIR` looks in DIR only. Nothing is downloaded: a missing file is one
message naming it, the folder to put it in, and the command that fetches it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

# The same names as `ae.training.perceptual` (which imports torch, so the launcher cannot).
VGG16_FILE = "vgg16-397923af.pth"
VGG16_URL = f"https://download.pytorch.org/models/{VGG16_FILE}"
HEADS_FILE = "vgg.pth"
HEADS_IN_WHEEL = "lpips/weights/v0.1/vgg.pth"
# The same names as `ae.training.inception`.
FID_FILE = "pt_inception-2015-12-05-6726825d.pth"
FID_URL = f"https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/{FID_FILE}"
AUTO = "auto"


def torch_hub_checkpoints(env: dict[str, str] | None = None) -> Path:
    """torch.hub's checkpoint folder, by its rule (`torch.hub.get_dir()` + `/checkpoints`)."""
    env = dict(os.environ) if env is None else env
    if env.get("TORCH_HOME"):
        home = Path(env["TORCH_HOME"]).expanduser()
    else:
        cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = Path(cache).expanduser() / "torch"
    return home / "hub" / "checkpoints"


def installed_lpips_heads() -> Path | None:
    """The v0.1 VGG heads of an installed `lpips` package, if one is installed: its location
    comes from the import system's finder, which runs none of its code."""
    spec = importlib.util.find_spec("lpips")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "weights" / "v0.1" / HEADS_FILE
    return path if path.is_file() else None


@dataclass(frozen=True)
class PerceptualFiles:
    vgg16: Path
    heads: Path
    folder: Path  # where missing files go

    def missing(self) -> list[Path]:
        return [p for p in (self.vgg16, self.heads) if not p.is_file()]


def resolve(value: str, env: dict[str, str] | None = None) -> PerceptualFiles:
    """The two files `--perceptual_weights=value` names (they may not exist)."""
    folder = torch_hub_checkpoints(env) if value == AUTO else Path(value).expanduser()
    heads = folder / HEADS_FILE
    if value == AUTO and not heads.is_file():
        heads = installed_lpips_heads() or heads
    return PerceptualFiles(vgg16=folder / VGG16_FILE, heads=heads, folder=folder)


def missing_problem(value: str, env: dict[str, str] | None = None) -> str | None:
    """The launcher's message when a file is missing (None when both are there): what each file
    is, where it goes, and how to get it."""
    files = resolve(value, env)
    if value != AUTO and files.folder.is_file():  # one of the two files, or another file
        return (
            f"{files.folder} is a file; give the folder holding {VGG16_FILE} and {HEADS_FILE} "
            f"(--perceptual_weights={files.folder.parent})"
        )
    if value != AUTO and not files.folder.is_dir():
        return f"no such folder: {files.folder} (a folder holding {VGG16_FILE} and {HEADS_FILE})"
    missing = files.missing()
    if not missing:
        return None
    folder = files.folder
    lines = [f"LPIPS needs {len(missing)} file(s) missing from {folder}:"]
    if files.vgg16 in missing:
        lines += [
            f"  {VGG16_FILE}: torchvision's VGG16 ImageNet weights (528 MB), from {VGG16_URL}",
            f"    curl -L --create-dirs -o {folder / VGG16_FILE} {VGG16_URL}",
        ]
    if files.heads in missing:
        lines += [
            f"  {HEADS_FILE}: the LPIPS v0.1 VGG heads (7 KB), {HEADS_IN_WHEEL} in the lpips wheel",
            "    pip download lpips==0.1.4 --no-deps -d /tmp/lpips && "
            f"unzip -j /tmp/lpips/lpips-0.1.4-py3-none-any.whl {HEADS_IN_WHEEL} -d {folder}",
        ]
    if value == AUTO:
        lines.append(
            "  (or put both in a folder of your own and pass --perceptual_weights=FOLDER; this "
            "machine may copy them from one that has them: nothing is downloaded at run time)"
        )
    return "\n".join(lines)


def fid_file(value: str) -> Path:
    """The file `--fid_weights=value` names: the file itself, or FID_FILE in a folder."""
    path = Path(value).expanduser()
    return path / FID_FILE if path.is_dir() else path


def fid_missing_problem(value: str) -> str | None:
    """The launcher's message when the FID Inception file is not there (None when it is): what
    it is, where it goes, and how to get it."""
    path = fid_file(value)
    if path.is_file():
        return None
    return "\n".join(
        [
            f"no such file: {path}: rFID needs the FID Inception v3 weights, pytorch-fid's "
            f"{FID_FILE} (91 MB), from {FID_URL}",
            f"  curl -L --create-dirs -o {path} {FID_URL}",
            "  (pytorch-fid keeps its copy in torch's cache, "
            f"{torch_hub_checkpoints() / FID_FILE}; nothing is downloaded at run time)",
        ]
    )

"""`ae-shards inspect`: what shards hold, what is damaged, and which flags a run on them needs.

Every sample is read. Each field is described by what it decodes to (`npy float32 (64,)`, `JPEG
image`, `int class` for WebDataset's `cls`, `bytes`), images by their size and mode (from their
headers), and the input field of a run (`--input_key`, or the first decodable field of the first
sample) is decoded the way training decodes it: a sample whose input field is missing, does not
decode, or (arrays, native-size images) is shaped unlike the first good one, is a bad sample. An
array holding NaN or Inf is counted apart (a run does not replace it: it trains on it, and its
loss turns non-finite), its shard and key named as the run names them. A sample that reads as
many files merged by WebDataset's key rule (`ae.data.shards.keys`) is named, with the fix.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ae.config import DataConfig
from ae.data.decoding.decode import (
    SampleDecoder,
    SampleError,
    decoding_extension,
    field_kind,
    npy_array,
    several_inputs,
    tensor_array,
    ungzipped,
)
from ae.data.decoding.images import GRAYSCALE_MODES, open_image, suggested_image_size
from ae.data.shards.errors import DataError
from ae.data.shards.index import index_url, read_index
from ae.data.shards.keys import merged_files
from ae.data.shards.spec import is_remote
from ae.data.shards.tar_samples import iter_samples
from ae.log_lines import NONFINITE_INPUT

# Images of several sizes are checked at this size when no --image_size is given: decoding is
# what finds damage, and a JPEG drafted for 64x64 decodes in a fraction of the time.
CHECK_SIZE = 64
# Fields WebDataset's default decoders read as integers (`webdataset.autodecode`): `cls` is a
# class label, the others counts and ids.
INT_FIELDS = ("cls", "cls2", "class", "count", "index", "inx", "id")
CLASS_FIELDS = ("cls", "cls2", "class")
# Samples with NaN/Inf named per shard (the rest counted): enough to find the rows, and a shard
# of nothing but NaN keeps its report short.
NONFINITE_NAMED = 5
# Bad samples and fields named per shard on the console (--json keeps them all): a shard of 10k
# samples with no decodable field, or a key whose dots made one sample of 120 fields, must not
# push the summary and its hints off the screen.
BAD_NAMED = 5
FIELDS_NAMED = 8


@dataclass
class ShardReport:
    url: str
    samples: int = 0
    index: str = "missing"  # ok / missing / stale / wrong count
    first_key: str = ""
    last_key: str = ""
    fields: list[str] = field(default_factory=list)
    field_types: dict[str, dict[str, int]] = field(default_factory=dict)  # field -> type: count
    image_sizes: dict[str, int] = field(default_factory=dict)  # "WxH" -> count
    image_modes: dict[str, int] = field(default_factory=dict)
    sample_bytes: list[int] = field(default_factory=lambda: [0, 0, 0])  # min, mean, max
    bad: list[list[str]] = field(default_factory=list)  # [key, reason]
    error: str | None = None  # why reading stopped early
    merged: str | None = None  # the first sample that reads as files merged (ae.data.shards.keys)
    nonfinite: int = 0  # samples whose input array holds a NaN or Inf
    nonfinite_keys: list[str] = field(default_factory=list)  # the first NONFINITE_NAMED of them

    @property
    def damaged(self) -> bool:
        return bool(self.bad or self.error or self.nonfinite)


def describe_field(name: str, data: bytes) -> tuple[str, tuple[str, str] | None]:
    """(what the field decodes to, (size, mode) for an image)."""
    kind = field_kind(name)
    ext = name.rpartition(".")[2]
    if kind is None and ext in INT_FIELDS:
        try:
            int(data)
        except ValueError:
            return "bytes", None
        return ("int class" if ext in CLASS_FIELDS else "int"), None
    if kind is None:
        return "bytes", None
    try:
        if kind == "image":
            with open_image(ungzipped(name, data)) as img:
                return f"{img.format} image", (f"{img.width}x{img.height}", img.mode)
        ext, gzipped = decoding_extension(name)
        raw = ungzipped(name, data) if gzipped else data
        if ext == "npy":
            array = npy_array(raw)
            return f"npy {array.dtype} {array.shape}", None
        if ext == "npz":
            with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
                arrays = ", ".join(f"{k}: {npz[k].dtype} {npz[k].shape}" for k in npz.files)
            return f"npz {{{arrays}}}", None
        return f"{ext} tensor {tensor_array(raw).shape}", None
    except Exception as e:  # reported as a type: the input field's decode names the sample
        return f"undecodable {ext if kind == 'vector' else 'image'} ({type(e).__name__})", None


class Inspector:
    """Reads shards one after the other; the first decodable sample fixes the run's decoder."""

    def __init__(self, input_key: str | None) -> None:
        self.cfg = DataConfig(input_key=input_key)
        self.decoder: SampleDecoder | None = None
        self.native: SampleDecoder | None = None  # the decoder at native size (first sample's)
        self.first_problem: str | None = None
        # Without --input_key, a first sample with several decodable fields (jpg + png,
        # input.jpg + target.png) is refused by a run (`input_probe`): said here the same way.
        self.several: str | None = None

    def _check(self, sample: dict) -> bool:
        """Decode the input field as a run would: whether its values are all finite (images
        always are); SampleError if it cannot be trained on."""
        if self.decoder is None:
            if not self.cfg.input_key and self.several is None:
                self.several = several_inputs(sample)
            self.native = SampleDecoder.probe(sample, self.cfg)
            self.decoder = self.native
            if self.native.kind == "image":  # sizes are reported, not judged: see hints()
                checked = DataConfig(input_key=self.cfg.input_key, image_size=CHECK_SIZE)
                self.decoder = SampleDecoder.probe(sample, checked)
                return True
        array = self.decoder.decode(sample)
        return self.decoder.kind == "image" or bool(np.isfinite(array).all())

    def shard(self, url: str) -> ShardReport:
        report = ShardReport(url)
        types: dict[str, Counter[str]] = {}
        sizes: Counter[str] = Counter()
        modes: Counter[str] = Counter()
        lengths: list[int] = []
        try:
            for sample in iter_samples(url):
                key = sample["__key__"]
                report.samples += 1
                report.first_key = report.first_key or key
                report.last_key = key
                fields = {k: v for k, v in sample.items() if not k.startswith("__")}
                if report.merged is None:
                    report.merged = merged_files(key, fields)
                lengths.append(sum(len(v) for v in fields.values()))
                for name, data in fields.items():
                    kind, image = describe_field(name, data)
                    types.setdefault(name, Counter())[kind] += 1
                    if image is not None:
                        sizes[image[0]] += 1
                        modes[image[1]] += 1
                try:
                    finite = self._check(sample)
                except SampleError as e:
                    report.bad.append([key, str(e)])
                    continue
                if not finite:
                    report.nonfinite += 1
                    if len(report.nonfinite_keys) < NONFINITE_NAMED:
                        report.nonfinite_keys.append(key)
        except DataError:  # --input_key cannot work on this data: the user's to fix
            raise
        except Exception as e:  # unreadable or truncated: report how far it got
            report.error = f"{type(e).__name__}: {e}"
        report.fields = sorted(types)
        report.field_types = {k: dict(v.most_common()) for k, v in sorted(types.items())}
        report.image_sizes = dict(sizes.most_common())
        report.image_modes = dict(modes.most_common())
        if lengths:
            report.sample_bytes = [min(lengths), sum(lengths) // len(lengths), max(lengths)]
        index = read_index(url)
        side = index_url(url)
        if index is not None:
            report.index = "ok" if index.samples == report.samples else "wrong count"
        elif side is not None and not is_remote(url) and Path(side).exists():
            report.index = "stale"
        return report

    def hints(self, reports: list[ShardReport]) -> list[str]:
        """What a training run on these shards needs, one line each (first: keys that WebDataset
        splits into many fields, if any)."""
        out = [r.merged for r in reports if r.merged][:1]
        if self.native is None and not any(r.samples for r in reports):
            # Nothing was read (a failed command or download, damaged files): the field is not
            # what is wrong, and the lines above say what is.
            return [*out, "no sample could be read: no training run can use these shards"]
        if self.native is None:
            return [
                *out,
                # without --input_key every decodable field is tried: naming one adds none
                "no sample decodes: no training run can use these shards",
            ]
        native = self.native
        how = (
            "--input_key"
            if self.cfg.input_key
            else "the default: the first decodable field of the first sample"
        )
        out.append(f"input field: {native.field_names} ({how})")
        if self.several and not any(r.merged for r in reports):  # else said first, with its fix
            why = self.several.removeprefix("input_key: ")
            out.append(f"a training run refuses these shards without --input_key: {why}")
        types: dict[str, Counter[str]] = {}
        for r in reports:
            for name, kinds in r.field_types.items():
                types.setdefault(name, Counter()).update(kinds)
        inputs = {f for f in types if native.accepts(f)}
        others = [f for f in types if f not in inputs and field_kind(f) is not None]
        if others:
            out.append(f"other decodable fields: {_first(others)} (--input_key picks one)")
        if native.kind == "vector":
            out += _array_hints(types, inputs, native)
            if nonfinite := sum(r.nonfinite for r in reports):
                out.append(
                    f"{_samples(nonfinite)} with NaN/Inf: a run trains on them as they are, and "
                    f"its loss turns non-finite (NONFINITE ... {NONFINITE_INPUT}, "
                    "--on_nonfinite); fix or drop them"
                )
        else:
            out += _image_hints(reports, native)
        return out


def _array_hints(
    types: dict[str, Counter[str]], inputs: set[str], native: SampleDecoder
) -> list[str]:
    out = [f"vectors of {native.shape[0]} values: an MLP autoencoder"]
    # `npy float32 (4, 8)`: arrays of 2 or more dimensions are flattened, which a run now says
    shapes = sorted({k[k.index("(") :] for f in inputs for k in types.get(f, {}) if ", " in k})
    shapes = [s for s in shapes if s.rstrip(")").split(", ")[-1]]  # not (16,)
    if shapes:
        shown = ", ".join(s.strip("()").replace(", ", "x") for s in shapes[:3])
        out[0] += f" (arrays of shape {shown} flattened)"
    dtypes = {kind.split()[1] for f in inputs for kind in types.get(f, {}) if " " in kind}
    integers = sorted(d for d in dtypes if d.startswith(("uint", "int")))
    if integers:
        out.append(
            f"integer arrays ({', '.join(integers)}) are used as stored; e.g. "
            "--npy_scale=0.00392156863 (1/255) maps 0..255 to 0..1"
        )
    return out


def shorter_sides(sizes: dict[str, int]) -> str:
    """The distribution of the images' shorter sides: `shorter side 51..769 px, median 232`."""
    sides = sorted(
        side for size, n in sizes.items() for side in [min(int(v) for v in size.split("x"))] * n
    )
    if not sides:
        return ""
    return f"shorter side {sides[0]}..{sides[-1]} px, median {sides[len(sides) // 2]}"


def _image_hints(reports: list[ShardReport], native: SampleDecoder) -> list[str]:
    sizes: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    for r in reports:
        sizes.update(r.image_sizes)
        modes.update(r.image_modes)
    out = []
    if len(sizes) > 1:
        areas = sorted(sizes, key=lambda s: int(s.split("x")[0]) * int(s.split("x")[1]))
        n = suggested_image_size(sizes)
        out.append(
            f"images of {len(sizes)} sizes ({areas[0]} .. {areas[-1]}; {shorter_sides(sizes)}):"
            f" pass --image_size (e.g. --image_size={n}: shorter side resized to {n}, then "
            f"cropped to {n}x{n})"
        )
    else:
        size = next(iter(sizes), "?")
        out.append(f"all images {size}: trains at native size; --image_size=N resizes them")
    shown = ", ".join(f"{m} {n}" for m, n in modes.most_common())
    gray = sum(n for m, n in modes.items() if m in GRAYSCALE_MODES)
    channels = 1 if native.mode == "L" else 3
    line = f"modes {shown}: all converted to {native.mode} ({channels} channel"
    line += "s" if channels > 1 else ""
    line += ", as the first image)"
    if channels == 3 and gray:
        line += "; --channels=1 trains on grayscale"
    elif channels == 1 and gray < sum(modes.values()):
        line += "; --channels=3 keeps the colour"
    return [*out, line]


def _first(names: list[str], n: int = FIELDS_NAMED) -> str:
    """The first n names, and how many more."""
    more = f", ... ({len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _samples(n: int) -> str:
    return f"{n} sample{'' if n == 1 else 's'}"


def print_reports(console: Console, reports: list[ShardReport], hints: list[str]) -> None:
    table = Table(
        "shard", "samples", "keys", "fields", "images", "bytes/sample (min/mean/max)", "index",
        "bad",
    )  # fmt: skip
    table.columns[0].overflow = "fold"
    for r in reports:
        fields = "; ".join(
            f"{name}: {', '.join(kinds)}"
            for name, kinds in list(r.field_types.items())[:FIELDS_NAMED]
        )
        if len(r.field_types) > FIELDS_NAMED:
            fields += f"; ... ({len(r.field_types) - FIELDS_NAMED} more fields)"

        images = ""
        if r.image_sizes:
            modes = "/".join(f"{m} {n}" for m, n in r.image_modes.items())
            sizes = f"{len(r.image_sizes)} size{'s' if len(r.image_sizes) > 1 else ''}"
            images = f"{sizes} ({shorter_sides(r.image_sizes)}); {modes}"
        table.add_row(
            r.url if is_remote(r.url) else Path(r.url).name,
            str(r.samples),
            f"{r.first_key}..{r.last_key}",
            fields,
            images,
            "/".join(str(b) for b in r.sample_bytes),
            r.index,
            str(len(r.bad))
            + (f" + {r.nonfinite} NaN/Inf" if r.nonfinite else "")
            + (" + unreadable" if r.error else ""),
        )
    console.print(table)
    for r in reports:
        if r.error:
            console.print(f"[red]{r.url}: unreadable after {r.samples} samples: {r.error}")
        for key, reason in r.bad[:BAD_NAMED]:
            console.print(f"[red]{escape(f'{r.url}: sample {key}: {reason}')}")
        if len(r.bad) > BAD_NAMED:
            more = len(r.bad) - BAD_NAMED
            console.print(f"[red]{escape(r.url)}: {more} more bad samples (--json lists all)")
        if r.nonfinite:
            # as a run's NONFINITE line names them: `shard URL, keys [k1, k2] (non-finite input)`
            keys = ", ".join(r.nonfinite_keys) + (", ..." if r.nonfinite > NONFINITE_NAMED else "")
            line = (
                f"{r.url}: {_samples(r.nonfinite)} with non-finite values (NaN/Inf): keys [{keys}]"
                f" {NONFINITE_INPUT}"
            )
            console.print(f"[red]{escape(line)}")
    damaged = sum(r.damaged for r in reports)
    total = sum(r.samples for r in reports)
    nonfinite = sum(r.nonfinite for r in reports)
    console.print(
        f"{len(reports)} shards, {total} samples; {sum(len(r.bad) for r in reports)} bad "
        f"samples, {f'{_samples(nonfinite)} with NaN/Inf, ' if nonfinite else ''}"
        f"{damaged} shards with bad data"
    )
    for hint in hints:
        console.print(f"- {hint}")

"""What the run's input is, read from the first samples of its shards: the decoder (field, kind
and shape), the check that native-size images all have one size, the warning for a grayscale
first image among colour ones (`--channels=0`), and the first decodable samples
(the real batch of the model check before training). The data module runs these from `setup`
(or when asked first, `ShardDataModule.probe`): building it reads no shard.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter

import numpy as np
import torch

from ae.config import DataConfig
from ae.data.decoding.decode import SampleDecoder, SampleError, several_inputs
from ae.data.decoding.images import GRAYSCALE_MODES, suggested_image_size
from ae.data.shards.errors import DataError
from ae.data.shards.tar_samples import iter_samples
from ae.log_lines import INPUT_FIELD, MIXED_MODES, main_log

# Samples tried before a split with no usable sample is given up on: the first samples of a
# dataset tell whether its fields can be decoded, without reading all of it.
PROBE_SAMPLES = 1000
# The headers (size, mode) of the input images of the first samples of the first shard and of
# the first sample of the next shards tell, cheaply, whether the run's images are all alike:
# at native size (no --image_size) they must have one size, and with --channels=0 a grayscale
# first image trains every colour one as gray.
HEADER_PROBE_FIRST_SHARD, HEADER_PROBE_SHARDS = 8, 16


def image_headers(
    urls: list[str], decoder: SampleDecoder, cfg: DataConfig
) -> list[tuple[str, str]]:
    """(`WxH`, mode) of the first samples' input images (see HEADER_PROBE_*), in the order read;
    none read when no check needs them (arrays; a fixed --image_size on a colour first image or
    with --channels given)."""
    if decoder.kind != "image":
        return []
    if decoder.image_size and (cfg.channels or decoder.mode != "L"):
        return []
    headers = []
    for i, url in enumerate(urls[:HEADER_PROBE_SHARDS]):
        wanted = HEADER_PROBE_FIRST_SHARD if i == 0 else 1
        with contextlib.suppress(Exception):  # a damaged shard: the readers report it
            for sample in itertools.islice(iter_samples(url), wanted):
                if (header := decoder.header(sample)) is not None:
                    headers.append(header)
    return headers


def check_one_image_size(
    split: str, headers: list[tuple[str, str]], decoder: SampleDecoder
) -> None:
    """DataError naming --image_size and the sizes seen when the first samples of the split
    (`image_headers`) have images of several sizes: the run would train only on those of the
    first sample's size, the others replaced by repeats of them."""
    if decoder.kind != "image" or decoder.image_size:
        return
    sizes = Counter(size for size, _ in headers)
    if len(sizes) > 1:
        shown = ", ".join(f"{size} ({n})" for size, n in sizes.most_common(5))
        raise DataError(
            f"{split}_shards: images of several sizes in the first {sum(sizes.values())} "
            f"samples read: {shown}{', ...' if len(sizes) > 5 else ''}; at native size only those "
            f"of the first one's could be trained on. Pass --image_size=N (the shorter side "
            f"resized to N, then cropped to NxN), e.g. --image_size={suggested_image_size(sizes)}"
        )


def colour_after_gray(
    headers: list[tuple[str, str]], decoder: SampleDecoder, cfg: DataConfig
) -> str | None:
    """The MIXED_MODES warning when --channels=0 made a grayscale first image train 1 channel
    while some of the next headers (`image_headers`) are in colour, which it takes to gray;
    None otherwise. The rule stays (docs/CONTRACT.md): only the user knows which was meant."""
    if decoder.kind != "image" or cfg.channels or decoder.mode != "L" or len(headers) < 2:
        return None
    later = [mode for _, mode in headers[1:]]
    colour = Counter(mode for mode in later if mode not in GRAYSCALE_MODES)
    if not colour:
        return None
    return MIXED_MODES.format(
        first=headers[0][1],
        colour=colour.total(),
        looked=len(later),
        modes=", ".join(f"{mode} {n}" for mode, n in colour.most_common()),
    )


def probe_decoder(
    split: str, urls: list[str], cfg: DataConfig, decoder: SampleDecoder | None = None
) -> SampleDecoder:
    """The decoder of the run, from the first sample that decodes (trying shards in order;
    damaged ones are reported by the planner and the readers, not here). With `decoder` (the
    train split's), check that this split's samples decode the same way and shape instead."""
    problem, tried = "no samples", 0
    for url in urls:
        try:
            for sample in iter_samples(url):
                tried += 1
                if decoder is None and not cfg.input_key and (why := several_inputs(sample)):
                    raise DataError(why)  # the input is the user's choice, never tar order's
                try:
                    if decoder is None:
                        return SampleDecoder.probe(sample, cfg)
                    decoder.decode(sample)
                    return decoder
                except SampleError as e:  # a bad sample: try the next one
                    problem = f"{url}: sample {sample['__key__']}: {e}"
                if tried == PROBE_SAMPLES:
                    break
        except DataError:  # flags that cannot work on this data
            raise
        except Exception as e:  # an unreadable shard: try the next one
            problem = f"{url}: {type(e).__name__}: {e}"
        if tried == PROBE_SAMPLES:
            break
    tried_what = f"first {tried} samples tried" if tried else "not one could be opened"
    raise DataError(
        f"{split}_shards: no readable sample in any of {len(urls)} shards ({tried_what}; "
        f"last problem: {problem})"
    )


def log_input(decoder: SampleDecoder, cfg: DataConfig) -> None:
    source = "--input_key" if cfg.input_key else "the first decodable field of the first sample"
    main_log.info(
        INPUT_FIELD.format(
            field=decoder.field_names,
            source=source,
            shape="x".join(map(str, decoder.shape)),
            detail=decoder.describe()
            + ("; JPEGs decoded on each rank's GPU (nvJPEG)" if cfg.image_decode == "gpu" else ""),
        )
    )


def first_decodable(urls: list[str], decoder: SampleDecoder, n: int) -> torch.Tensor:
    """The first `n` (or fewer) samples of `urls` that decode, as a batch, read from the start
    of the first shards (bad samples and unreadable shards skipped: the planner and the readers
    report them)."""
    found: list[np.ndarray] = []
    for url in urls:
        try:
            for sample in iter_samples(url):
                try:
                    found.append(decoder.decode(sample))
                except SampleError:
                    continue
                if len(found) == n:
                    return torch.from_numpy(np.stack(found))
        except DataError:
            raise
        except Exception:  # an unreadable shard
            continue
    return torch.from_numpy(np.stack(found))  # the probe found at least one

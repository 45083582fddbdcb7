"""The run's position, owned in one place: what a checkpoint says about where the run is, how a
resume with other settings maps onto the new plan, and what Lightning is told of it.

- `checkpoint_read.py`: every load of a checkpoint: the safe loader; a damaged file named, with
  the newest complete one that loads.
- `resume_source.py`: `--resume_from_checkpoint`: which file, read once before training; the
  logger runs it continues.
- `model_fit.py`: a checkpoint whose model these flags cannot build, refused before training.
- `arithmetic.py`: pure: where a resumed epoch stands (epoch, batch, length, samples trained).
- `lightning_progress.py`: Lightning's fit-loop progress rewritten from ae's position.
- `sync.py`: the callback that does so on every resume, and each rank's `Trained in epoch` lines.

The data stream carries the position out (`ae.data.stream.resume`: which samples are left of an
epoch under other settings); this package decides what every other part of the run is told.
"""

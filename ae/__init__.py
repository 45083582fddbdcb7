"""ae: a streaming autoencoder trainer with per-rank observability.

The layout is the architecture; imports go one way (tests/test_architecture.py enforces it):

    logging_cfg/        sinks, hooks, record and file-name formats (imports nothing from ae)
    ae/ core            config (flags, in typed sections), errors (UserError), log_lines
                        (every greppable line), run_paths (every path of a run folder)
    ae/forensics/       what a rank is doing and what it leaves behind: progress, watchdog,
                        heartbeat, stall reports, process stats, fault injection, loop tracer
    ae/data/            shards -> batches, in layers: shards/ (specs, tar reading and writing,
                        counting, the demo data) <- decoding/ | planning/ (counts, the even
                        split) <- stream/ (the stream, loaders, resume) <- the data module;
                        tools/: ae-shards' write, index, inspect, bench
    ae/training/        the model and its fit: LR, trainer, checkpoints, preemption,
                        sampling, metrics
    ae/job/             the job launcher (torch-free): layouts, run-folder lock, preflight,
                        network, torchrun, supervision, outcome; ae-encode's launch too
    ae/rank/            what one rank does: train, encode, and how a rank process ends
    ae/cli/             thin entry points: argument parsing -> a call (ae-train, ae-encode,
                        ae-shards; the processes torchrun starts for each rank)
    ae/diagnose/        ae-diagnose: reads a run's files (torch-free; sees only the core)
"""

"""ae: a streaming autoencoder trainer with per-rank observability.

The layout is the architecture; imports go one way (tests/test_architecture.py enforces it):

    logging_cfg/        sinks, hooks, record and file-name formats (imports nothing from ae)
    ae/ core            config (flags, in typed sections), errors (UserError), log_lines
                        (every greppable line), run_dir (every path of a run folder)
    ae/forensics/       what a rank is doing and what it leaves behind: progress, watchdog,
                        heartbeat, stall reports, process stats, fault injection, loop tracer
    ae/data/            shards -> batches: specs, tar reading, decoding, counting, the even
                        split, the stream, loaders, resume, writing shards, the demo data
    ae/training/        the model and its fit: LR, trainer, checkpoints, preemption,
                        sampling, metrics
    ae/cli/             entry points: the launcher, one rank's flow, ae-shards
    ae/diagnose/        ae-diagnose: reads a run's files (torch-free; sees only the core)
"""

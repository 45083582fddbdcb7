"""Training: the autoencoder, its learning-rate recipe, the Lightning trainer and callbacks
(validation schedule, checkpoints, preemption, reconstruction sampling, metrics). Imports data,
forensics, the core and logging_cfg."""

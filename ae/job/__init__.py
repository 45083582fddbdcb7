"""The job launcher behind ae-train and ae-encode, torch-free (docs/LAUNCHER.md says how it works):
the job's layout, the run-folder lock, the preflight, the network of several nodes, torchrun,
the supervision of the ranks and how the job ended. Imports data, forensics, the core and
logging_cfg; never torch, Lightning or ae.training (tests/test_architecture.py)."""

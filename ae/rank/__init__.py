"""What one rank process does, top to bottom: `train` (a training rank), `encode` (an ae-encode
rank), and `exit` (how either ends: its exit code and last line). The processes torchrun starts
are the small modules in ae/cli (`rank_process`, `encode_rank`). Imports training, job, data,
forensics, the core and logging_cfg."""

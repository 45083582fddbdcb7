"""`ae-diagnose`: which rank holds a job back, from the files of a live or dead run.

Modules, one concern each: `run_files` (which files make a run), `logscan` (fast byte-level
search of a log), `heartbeats`, `phases`, `rank_log` (one rank's state), `run_state` (all of
them, the time frame), `verdict` (the rules naming culprits), `resources` (the resource that
ran out), `stragglers` (slow ranks), `report` (`diagnose`: the JSON object, and the rich table),
`watch` (live view of the heartbeats), `bundle` (tarball for a bug report), `cli`. Importing one
of them loads only what it needs (nothing here).
"""

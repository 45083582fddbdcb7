"""`ae-diagnose`: which rank holds a job back, from the files of a live or dead run.

Modules, one concern each: `log_files` (which files make a run), `logscan` (fast byte-level
search of a log), `heartbeats`, `phases`, `rank_log` (one rank's state), `tracebacks` (its
crashes and faulthandler dumps), `evidence` (all of them, the time frame), `flight_recorder`
(the ranks' collectives dumps), `collectives` (their mismatches), `rank_status` (what a rank's
state says), `verdict` (`judge`, the rules in order), `verdict_rules` (each rule), `findings`
(what the rules find), `resources` (the resource that ran out), `stragglers` (slow ranks),
`report` (`diagnose`: the JSON object, and the rich table), `watch` (live view of the
heartbeats), `bundle` (tarball for a bug report), `cli`. Importing one of them loads only what
it needs (nothing here).
"""

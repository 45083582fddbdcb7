"""Forensics: what a rank is doing (progress beats, phases), the watchdog that reports a rank
that stops making progress (STALL with stacks and memory), the heartbeat file ae-diagnose reads,
process stats, fault injection for tests (AE_FAULT), and the loop tracer (epoch markers, step
lines). Imports only the core and logging_cfg."""

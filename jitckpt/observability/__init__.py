"""What a job tells its operators: the event log, metrics, the console, reports and analysis.

:mod:`.events` (``events.jsonl``, the source of truth) feeds :mod:`.metrics` (Prometheus),
:mod:`.status_display` (the console) and :mod:`.report` (``jitckpt report``);
:mod:`.analysis` / :mod:`.analyze_cli` are the JIT paper's cost model (``jitckpt analyze``).
"""

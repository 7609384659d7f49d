"""SWIFT logging-based recovery of pipeline-parallel training.

Logging: :mod:`.logging_sender` (upstream backup of each stage's sends), :mod:`.logging_records`
(the chunk format), :mod:`.logging_replay` (serving logged inputs in order), with
:mod:`.logging_determinism` and :mod:`.selective_logging`. Running a stage: :mod:`.schedule`,
:mod:`.channel` (live peers or logs), :mod:`.stage`. Recovery: :mod:`.recovery`,
:mod:`.parallel_recovery`, :mod:`.failure_flag`, :mod:`.store`, and :mod:`.stage_membership` (a
worker's place in a ``jitckpt run --recovery stage`` job). The runtime that puts these together:
:mod:`.run_config` (``PipelineRun``, what a run trains and how it recovers), :mod:`.stage_runtime`
(one stage's process across process-group generations, ``run_stage``), :mod:`.forked_supervisor`
(``run_pipeline``: the stages as forked processes of one supervisor, without the launcher),
:mod:`.reference_model` (``MlpStages``, the stage builder of the tests, benchmark and example) and
:mod:`.fault_plan` (``FaultPlan``, failure injection for tests, benchmark and demo).
"""

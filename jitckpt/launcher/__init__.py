"""The launcher side: `jitckpt run` on one node (torch only for c10d's TCPStore across nodes).

It owns the worker processes and the decision what to do after a failure:

* :mod:`.config` -- the flags of `jitckpt run` (torchrun's and jitckpt's) and their validation;
* :mod:`.supervisor` -- one node's launcher: start workers from warm standbys, watch their control
  channels, detect deaths and preemption, hand a failure to a recovery strategy;
* :mod:`.worker_handle` -- what the launcher knows of one worker process;
* recovery strategies, one module each: :mod:`.jit_recovery` (the survivors save a JIT
  checkpoint, the whole job restarts from it) and :mod:`.stage_replacement` (``--recovery
  stage``: one dead pipeline stage is replaced alone);
* :mod:`.standby_pool` -- processes that have imported torch and wait for a rank;
* :mod:`.node_coordinator` -- generations and failures across nodes through node 0's c10d store;
* :mod:`.stage_generations` -- ``--recovery stage``: the job store, generations and budget;
* :mod:`.keeper_supervisor` -- the node's snapshot keeper process (``--snapshot-every``).

Data flow: workers report steps, failures and saved checkpoints over :mod:`jitckpt.protocol`; the
launcher writes what happened to :mod:`jitckpt.observability`'s event log.
"""

"""The worker side: what runs inside each training process (imports torch).

* :mod:`.current` -- the process's one :class:`~.worker_runtime.WorkerRuntime`;
* :mod:`.worker_runtime` -- failure detection, the consistent-state JIT save, periodic saves, the
  exit barrier, talking to the launcher;
* :mod:`.collective_hooks` -- every wait on other ranks as a *region* the watchdog can time;
* :mod:`.watchdog` -- the hang timeout policy and the thread that applies it;
* :mod:`.protected_state` -- ``jitckpt.protect()``: a correct save/restore of plain torch objects;
* :mod:`.ddp_buffers`, :mod:`.ddp_layout` -- what DDP keeps outside the state dicts (buffers as
  broadcast, RNG, bucket layout) so a resume is bitwise;
* :mod:`.preemption_signals` -- SIGTERM/SIGINT reach a helper thread even while the main thread
  is blocked in a collective;
* :mod:`.standby` -- the warm standby process that becomes a worker;
* :mod:`.generation_store` -- each generation's c10d store, bound to the rendezvous address;
* :mod:`.peer_failure` -- which exceptions mean a peer or the transport failed.
"""

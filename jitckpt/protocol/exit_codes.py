"""Worker exit codes the launcher understands (besides 0 and signals)."""
EXIT_JIT_SAVED = 75      # saved a JIT checkpoint after a failure; restart the job
EXIT_NO_SAVE = 76        # a failure was detected but this rank could not save
EXIT_LAUNCHER_GONE = 77  # the control channel closed: the launcher died

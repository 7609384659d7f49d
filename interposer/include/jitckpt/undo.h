/* SWIFT update-undo for native programs under `jitckpt run --transparent --plugin undo` (issue 16
   case 4, the survivors' variant).

   A failure inside the optimizer step leaves the parameters and optimizer state partly updated on
   every rank, and no replica holds the state of either minibatch boundary. With the undo plugin the
   recovery runs, in the new device proxy, the inverse of each optimizer-step kernel that had run
   (newest first), which brings the buffers back to the minibatch's start, and then replays the
   minibatch. Without it such a failure falls back to user-level recovery.

   Register every kernel the program launches between jitckpt_mark_optimizer_step() and the next
   jitckpt_mark_minibatch(), once, after the kernels' module is loaded (any time before the first
   optimizer step):
     - jitckpt_register_inverse(kernel, inverse): `inverse` takes the same parameters and, run on
       the buffers `kernel` left, writes them back as they were before it (e.g. p += lr * v for
       p -= lr * v). The undo is exact only as far as the arithmetic is: SWIFT computes its inverses
       in higher precision for that reason.
     - jitckpt_register_inverse(kernel, NULL): `kernel` writes nothing that outlives the minibatch
       (a norm into a scratch buffer): nothing to undo.
   A kernel of the optimizer step that is not registered makes such a failure unrecoverable
   transparently (it says which kernel).

   Returns 0, or non-zero with the reason on stderr (an unknown kernel, parameters of another
   layout). Outside proxy mode it does nothing and returns 0. Weak, like marks.h. */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

int jitckpt_register_inverse(const void* kernel, const void* inverse) __attribute__((weak));

#ifdef __cplusplus
}
#endif

/* A call site that works with or without libjit.so. */
static inline int jitckpt_undo_with(const void* kernel, const void* inverse) {
  return jitckpt_register_inverse ? jitckpt_register_inverse(kernel, inverse) : 0;
}

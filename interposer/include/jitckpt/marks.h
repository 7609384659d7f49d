/* Minibatch marks for native (non-PyTorch) training programs run under libjit.so.

   In proxy mode (`jitckpt run --transparent`) they bound the replay journal to one minibatch: a
   transparent recovery then replays only the current minibatch's calls, on top of the buffers the
   minibatch started with. PyTorch programs get the same marks from the Python runtime's optimizer
   hooks and need nothing here.

   Call jitckpt_mark_minibatch() before each minibatch's first device call (its input copies) and
   jitckpt_mark_optimizer_step() before the optimizer step's first device call. Between the two, the
   program must not change parameters or optimizer state on the device; buffers it reads there must
   be written in the same minibatch before they are read (activations, gradients) or be left alone
   (parameters).

   The declarations are weak: a program built with them runs without libjit.so too, where the marks
   do nothing. */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

void jitckpt_mark_minibatch(void) __attribute__((weak));
void jitckpt_mark_optimizer_step(void) __attribute__((weak));

#ifdef __cplusplus
}
#endif

/* Call sites that work with or without libjit.so. */
static inline void jitckpt_minibatch(void) {
  if (jitckpt_mark_minibatch) jitckpt_mark_minibatch();
}
static inline void jitckpt_optimizer_step(void) {
  if (jitckpt_mark_optimizer_step) jitckpt_mark_optimizer_step();
}

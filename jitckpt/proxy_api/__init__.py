"""What proxy mode does with each CUDA runtime and NCCL entry point (issue 15), in one place.

* :mod:`.inventory` -- every function ``cuda_runtime_api.h``, ``nccl.h`` and ``nccl_device.h``
  declare, with its parameters and what their types say (generated from the real headers into
  ``cuda_api_inventory.json``; a test keeps it in step with the headers);
* :mod:`.dispositions` -- the one list of what proxy mode forwards asynchronously, handles by
  hand, computes in the client, or refuses (and why); every other declared function whose
  parameters are plain values, handles or pointers to plain results is forwarded by the
  generated layer;
* :mod:`.trampolines` -- what the real libraries export beyond the declared functions
  (deprecated and graphics-interop runtime functions, internal ABI, ...): libjit.so exports a
  trampoline for each that refuses it in proxy mode;
* :mod:`.coverage` -- ``jitckpt doctor --api-coverage``: per library, how many of the symbols
  PyTorch's CUDA wheel imports (``torch_cu130_imports.txt``) fall in each class, and how many
  work in proxy mode today.
"""

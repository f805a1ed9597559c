"""Device "cuda" on the CPU: what the package runs instead of a GPU when ``MT_EMULATE_CUDA=1``.

    emulator.py   csrc/ compiled with g++ against emu.h: each kernel's threads as CPU threads,
                  with CUDA's barriers, shuffles, cp.async and mma.sync; plain, or under
                  AddressSanitizer/UBSan or ThreadSanitizer, or with planted bugs
    emu.h         how CUDA is emulated
    cupy.py       a CuPy stand-in over NumPy whose kernels are the emulator's build of csrc/
    nccl.py       ``cupy.cuda.nccl`` for the emulated device, carried over MPI

This package stands beneath ``backend``, as CuPy and NCCL do: ``backend`` loads ``cupy`` and
``nccl`` from here when ``MT_EMULATE_CUDA=1``, and nothing here imports the rest of the package.
It is a device, not a test helper: the same launchers, bindings and kernels that a GPU runs
are run here, so that a machine without one can check them and a reader can step through them.
"""

"""Support for tests, and for reading the GPU path on a machine without one.

    gradcheck.py      ``gradcheck``: autograd against central finite differences
    emulator/         csrc/ compiled with g++ for the CPU: the kernels' threads as OS threads
    emulated_cuda.py  device "cuda" on the CPU (``MT_EMULATE_CUDA=1``): a CuPy stand-in over
                      NumPy whose kernels are the emulator's build of csrc/
    emulated_nccl.py  ``cupy.cuda.nccl`` for the emulated device, carried over MPI

Nothing here is imported in normal use. This ``__init__`` imports nothing, so that
``backend`` can load the emulated device before any other layer of the package exists.
"""

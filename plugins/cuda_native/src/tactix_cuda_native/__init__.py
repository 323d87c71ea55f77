"""tactix-cuda-native: the ``cuda_native`` backend (the project's own CUDA kernels). Importing it never touches CUDA."""

__version__ = "0.1.0"

__all__ = ["__version__"]

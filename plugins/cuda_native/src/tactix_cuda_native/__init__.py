"""tactix-cuda-native: the ``cuda_native`` backend (the project's own CUDA kernels). Importing it never touches CUDA."""

from typing import Final

__version__ = "0.1.0"

NAME: Final = "cuda_native"
"""The backend's name (its tactics' ``backend``)."""

__all__ = ["NAME", "__version__"]

"""tactix-cudnn: the ``cudnn`` backend (cuDNN frontend graphs). Importing it never touches CUDA."""

__version__ = "0.1.0"

__all__ = ["__version__"]

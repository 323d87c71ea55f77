"""tactix-trtllm: the ``trtllm`` backend (TensorRT-LLM's XQA and FMHAv2 attention kernels, as
flashinfer-python ships them). Importing it touches neither CUDA nor flashinfer."""

__version__ = "0.1.0"

__all__ = ["__version__"]

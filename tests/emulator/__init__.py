"""A CPU emulation of the cuda_native kernels' CUDA features (tx_emulate.h) and its Python driver."""

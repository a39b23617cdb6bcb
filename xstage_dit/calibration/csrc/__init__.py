"""CUDA C++ sources (plain C ABI) and their nvcc build + ctypes bindings."""

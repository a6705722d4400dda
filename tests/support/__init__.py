"""What tests and benchmarks share: polling (`waiting`) and local ports (`net`), defined once.

Importable by `bench/` on the GPU machine too (`bench/gpu_prepare.py` copies this package)."""

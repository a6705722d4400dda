"""What tests and benchmarks share: polling (`waiting`), local ports (`net`) and the
test model (`model`), defined once.

Importable by `bench/` on the GPU machine too (`bench/gpu_prepare.py` copies this package)."""

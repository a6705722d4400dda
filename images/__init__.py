"""Build scripts for what Ember ships: its container images (`build`) and llama.cpp (`llama_build`:
the llama-cpp-python wheel `make install` uses, and llama-server, the runtime's peer in tests and
bench). Not packaged; run from the repository root (`python -m images.build`).
"""

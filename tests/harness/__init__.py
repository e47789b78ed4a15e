"""What the tests drive and their long runs repeat at full size (``python -m tests.harness.<name>``): faults injected
at the KV reader, processes killed mid-save, the server fuzzed and probed, torch calls counted per step, and the GPU
diagnostics of tests/test_cuda.py's cases."""

"""The machine a process runs on: what its CPU can do (cpu_features.py, read by the controller's checks and the
trainer), how a torch process is tuned to it at start (torch_threads.py, startup_gc.py, memory.py), and a way
round a CPython 3.11 threading bug in `ast.parse` (safe_ast.py). Every module here is a leaf: it imports nothing
else of the package. Importing this package imports nothing."""

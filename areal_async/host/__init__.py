"""The machine a process runs on: what its CPU can do (cpu_features.py, read by the controller's checks and the
trainer), and how a torch process is tuned to it at start (torch_threads.py, startup_gc.py, memory.py). Every
module here is a leaf: it imports nothing else of the package. Importing this package imports nothing."""

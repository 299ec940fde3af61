"""C kernels for the CPU decode path, built on first use (see `build`) and cached by source fingerprint."""

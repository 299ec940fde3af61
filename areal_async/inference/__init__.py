"""Generation: the SGLang-protocol HTTP client (no torch) and the embedded server, engine and model (torch)."""

"""Weight formats shared by the processes that write weights (the trainer ranks) and those that load them (the
inference servers): the delta files (delta.py), the content digests that prove which version a server holds
(digest.py) and the LoRA adapter directories (lora_adapter.py). Importing this package imports nothing."""

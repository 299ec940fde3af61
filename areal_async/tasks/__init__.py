"""Tasks with verifiable answers, and the tokenizer the project's tiny models use."""

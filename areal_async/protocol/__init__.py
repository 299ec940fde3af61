"""Wire formats as pure, torch-free functions: SGLang's HTTP protocol, OpenAI's requests and answers, and the seam
between the embedded server and its engine. Used by the server, the agent proxy and the tests alike."""

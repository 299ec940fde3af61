"""The torch-free inference client: SGLang-protocol requests over HTTP, routing and transport, resumable
generations, and the set of servers a run talks to. The servers themselves are in `areal_async.server`."""

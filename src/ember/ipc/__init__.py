"""Several API processes, one engine process: the wire format, the engine's side of the
IPC and the API processes' client (ZeroMQ + msgpack)."""

"""Several API processes, one engine process: the wire format (`wire`) and a batch of items
on it (`batch`), the engine's calls over a registry without any transport (`calls`), the
models as an API process sees them (`models`), the engine's side of the ZeroMQ IPC
(`engine`), the API processes' client (`client`), and the tie that ends a child with its
supervisor (`lifeline`)."""

"""The ZeroMQ server, the Python client and the `paged-run` CLI."""

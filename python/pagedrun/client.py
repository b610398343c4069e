"""`pagedrun.client`: the Python clients of the paged-run server (implemented in server/client.py).

    from pagedrun.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        for delta in c.stream("What is the capital of France?"):
            print(delta.text, end="", flush=True)
"""
from pagedrun.server.client import (AsyncClient, AsyncStream, CapacityError, Client, Completion,
                                    Delta, DuplicateRequestIdError, EmptyPromptError,
                                    InternalServerError, InvalidRequestError, LeaseExpiredError,
                                    OverloadedError, PromptTooLongError, ProtocolMismatchError,
                                    RequestTimeout, ServerError, ServerUnavailable,
                                    ShuttingDownError, Stream)

__all__ = ["AsyncClient", "AsyncStream", "CapacityError", "Client", "Completion", "Delta",
           "DuplicateRequestIdError", "EmptyPromptError", "InternalServerError",
           "InvalidRequestError", "LeaseExpiredError", "OverloadedError", "PromptTooLongError",
           "ProtocolMismatchError", "RequestTimeout", "ServerError", "ServerUnavailable",
           "ShuttingDownError", "Stream"]

"""Generated messages of the standard gRPC interop test service (``grpc.testing``)."""

"""The data plane: job runtime, collation, gRPC server."""

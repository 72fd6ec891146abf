"""hotloop-serve: GGUF chat models over gRPC on Ray Serve, with sessions whose KV caches stay hot."""

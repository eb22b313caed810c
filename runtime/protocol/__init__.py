"""Protocol adapters: HTTP/REST and gRPC front ends over the data plane, with their codecs."""

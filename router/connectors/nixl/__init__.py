"""NixlConnector in pull mode, with bidirectional D->P reuse (`--kv-connector nixl`)."""

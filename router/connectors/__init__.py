"""KV-transfer connectors: one module per protocol behind one Protocol, chosen by --kv-connector."""

"""MoRIIOConnector (`--kv-connector moriio`): request-id addressing, announced instances."""

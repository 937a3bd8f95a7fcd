"""NixlPushConnector (`--kv-connector nixl-push`): P writes into D, both legs at once."""

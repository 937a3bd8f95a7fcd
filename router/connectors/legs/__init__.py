"""The legs the connectors share: P's call, D's call and relay, the handover, P then D."""

"""Start-up and what keeps the pool true: discovery, registry following, health, the demo."""

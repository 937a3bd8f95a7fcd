"""Store-based P/D (`--kv-connector store`): KV through a shared store, no fields."""

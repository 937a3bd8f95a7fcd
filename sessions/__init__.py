"""Conversation state for kvbaton: pure model, digests and the session stores."""

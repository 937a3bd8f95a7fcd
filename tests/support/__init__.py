"""What only the tests share: the turn's `Services` (services), a D that answers as a test says
(fake_d) and a Redis proxy that delays calls (slow_redis). What bench/ shares with the tests is
the top-level `harness` package."""

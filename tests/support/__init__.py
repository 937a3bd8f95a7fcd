"""What the tests (and bench/) share: processes (procs), the router (router), a whole stack
(stack), chat turns (chat), Prometheus text (metrics) and the turn's `Services` (services). Real
components only."""

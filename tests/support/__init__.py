"""What the tests (and bench/) share: processes (procs), the router (router), a whole stack
(stack), chat turns (chat) and Prometheus text (metrics). Real components only."""

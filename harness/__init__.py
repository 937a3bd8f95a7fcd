"""What the tests and bench/ share, the one harness both import: processes and ports (procs),
start-up waits scaled to the machine's load (waiting), the router (router), a whole stack
(stack), chat turns (chat) and Prometheus text (metrics). Real components only."""

"""`python -m vllm_sim` runs the simulator (the same as `kvbaton sim`)."""

from vllm_sim.cli import main

raise SystemExit(main())

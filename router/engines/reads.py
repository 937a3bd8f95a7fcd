"""What a P does with the D->P read it is offered, learned from its answers (issue 49). Pure:
the turn feeds it what P reported.

vLLM's P reads from D only the tokens its own prefix cache lacks, and skips a read of fewer
than its `kv_recompute_threshold` (64 by default; 0 in a deployment that forces every pull):
it recomputes them, and the handle cost the turn P's /tokenize and the verification for
nothing. vLLM does not publish the threshold, so the router learns it: a read P skipped of n
tokens says the threshold is above n. A P that skips reads is taken to run vLLM's default from
then on (so a skipped read or two, not one per token count, teaches it). What P still holds
of the conversation's last prompt is learned too: under cache pressure it evicts, and the
tokens it lacks are then the whole conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_RECOMPUTE_THRESHOLD = 64  # vLLM's default kv_recompute_threshold (bidirectional)
# A read skipped with this many lacking tokens or more is a failure, not a threshold.
SKIPS_UP_TO = 4 * VLLM_RECOMPUTE_THRESHOLD
SKIPS_TO_LEARN = 2
KEPT_WEIGHT = 0.3  # the weight of the newest observation in `kept`


@dataclass
class Reads:
    """One P's reads as seen so far (reset when the P restarts: its settings may differ)."""

    floor: int = 0  # the fewest lacking tokens worth a read to this P (0: it reads any)
    # The share of its last prompt's full blocks P still held when the conversation came back
    # without a read (an average that favours the newest; 1 until P reports otherwise).
    kept: float = 1.0
    reports_cached: bool = False  # P's answers carry cached_tokens (none then means 0)
    skips: int = 0  # small reads P skipped
    restarts: int = 0  # the P restarts these were learned under

    def current(self, restarts: int) -> Reads:
        """Itself, forgotten first if P restarted since."""
        if restarts != self.restarts:
            self.floor, self.kept, self.skips, self.restarts = 0, 1.0, 0, restarts
        return self

    def skipped(self, lacking: int) -> None:
        """P read nothing of a handle whose `lacking` tokens its cache did not hold. A read
        that failed under `kv_load_failure_policy=recompute` looks the same, so one skip
        teaches nothing and a large one (SKIPS_UP_TO) never does: the second small one does."""
        if not 0 < lacking < SKIPS_UP_TO:
            return
        self.skips += 1
        if self.skips >= SKIPS_TO_LEARN:
            self.floor = max(self.floor, lacking + 1, VLLM_RECOMPUTE_THRESHOLD)

    def cached(self, cached: int | None, expected: int) -> None:
        """P, sent no handle, reported `cached` prompt tokens where its cache held `expected`
        after the conversation's last turn (None: P did not say)."""
        if cached is not None:
            self.reports_cached = True
        elif self.reports_cached:
            cached = 0  # vLLM leaves the details out when nothing was cached
        if cached is None or expected <= 0:
            return
        share = min(1.0, cached / expected)
        self.kept += KEPT_WEIGHT * (share - self.kept)

"""What a benchmark run does: the full and quick plans, and the simulated GPU cost profile."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuProfile:
    """vllm_sim cost model for Llama-3-8B on one H100 (sources in SOURCES and the report)."""

    prefill_ms_per_token: float = 0.040
    decode_ms_per_token: float = 7.5
    transfer_ms_per_block: float = 0.05
    transfer_ms_per_pull: float = 0.5
    pull_step_ms: float = 1.0
    block_size: int = 16
    first_token_forward_ms: float = 7.5  # a forward's fixed cost, as a decode step's

    def turn_limit_ms(self, prompt: int, reused: int) -> float:
        """The cost model's TTFT for a P/D turn of `prompt` tokens whose first `reused` are
        D's KV: P computes only the new tokens (at least the last one, as vLLM), the first
        token is decoded, and every block moves once (the reused ones D -> P, the new ones
        P -> D), each pull paying its fixed cost and the empty step that reports it on an
        idle engine; P's prefill is one forward, D's first token another. No queueing, no
        HTTP, no tokenizing. A P whose prefix cache holds part of the conversation moves
        less, and a turn on D alone moves nothing and runs one forward."""
        reused = min(reused, prompt - 1) // self.block_size * self.block_size
        new = prompt - reused
        blocks = reused // self.block_size + -(-new // self.block_size)
        pulls = 2 if reused else 1
        return (
            new * self.prefill_ms_per_token
            + self.first_token_forward_ms
            + blocks * self.transfer_ms_per_block
            + pulls * (self.transfer_ms_per_pull + self.pull_step_ms)
            + self.decode_ms_per_token
        )

    def sim_args(self) -> list[str]:
        """vllm_sim's flags: `--prefill-ms-per-token 0.040` and so on, in this order."""
        names = ["prefill_ms_per_token", "decode_ms_per_token", "transfer_ms_per_block"]
        names += ["transfer_ms_per_pull", "pull_step_ms", "first_token_forward_ms", "block_size"]
        return [x for n in names for x in (f"--{n.replace('_', '-')}", str(getattr(self, n)))]


# The profile of results files that do not record theirs (measured before the forward's fixed
# cost was modelled): the report says which parts ran on it.
EARLIER = GpuProfile(prefill_ms_per_token=0.046, first_token_forward_ms=0.0)

LAMBDA_H100 = (
    "https://github.com/LambdaLabsML/vllm-benchmark/blob/main/results/prompt_10/"
    "1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len4096.json"
)
VLLM_CI = "https://buildkite.com/vllm/performance-benchmark/builds/9515"

SOURCES = {
    "prefill": (
        f"[LambdaLabsML/vllm-benchmark]({LAMBDA_H100}): vLLM, Llama-3-8B-Instruct, 1x H100 SXM: "
        "10 prompts with 1369 input tokens in all, sent at once (one step), median TTFT "
        "62.8 ms: less one forward's fixed cost (below), 55.3 ms for 1369 tokens, 0.040 ms "
        "per token. Arithmetic (16 GFLOP/token at 30-50% of 989 TFLOP/s) gives 0.03-0.05 ms."
    ),
    "decode": (
        f"the same run: median TPOT 7.46 ms (batch of up to 10). Cross-check, vLLM's own "
        f"[performance CI]({VLLM_CI}): latency_llama8B_tp1, batch 8, 32 in / 128 out, median "
        "833.5 ms on an H200, 6.5 ms per step."
    ),
    "forward": (
        "a step is one forward, and its fixed cost (reading the weights: 16 GB at 3.35 TB/s "
        "is 4.8 ms, plus the step's overheads) is the decode step's: a prompt's last forward "
        "costs it even alone, and a D leg that pulled its whole prompt runs it too (vLLM "
        "recomputes the last prompt token to sample token 1: `_update_waiting_for_remote_kv`)."
        " Beside running decodes it rides their forward (paid once per step)."
    ),
    "transfer": (
        "assumption (no published NIXL figure found for this model): Llama-3-8B KV is "
        "32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB per token, 2 MiB per "
        "16-token block; over a 400 Gb/s RDMA NIC at ~40 GB/s that is 0.05 ms per block."
    ),
    "pull": (
        "estimate (no published figure for a short read): building and posting one NIXL read, "
        "polling its completion and D's free notification, beside its blocks. vllm#50913 "
        "measured ~7 ms posts for 5k-token pulls at block size 16, i.e. ~0.02 ms per block: "
        "the per-block cost carries a long pull, this fixed part a short one."
    ),
    "step": (
        "estimate: on an idle engine the empty engine-core step (a scheduler pass and "
        "`kv_connector_no_forward`, no forward) that reports a finished read before the "
        "request is prefilled (vLLM's WAITING_FOR_REMOTE_KVS; docs/simulator.md). vllm#4261 "
        "measured V0's scheduler iteration at 2-2.5 ms; V1's loop is leaner and vllm#35781 "
        "cut the cost of parked requests. On a busy engine the running step reports it."
    ),
}


@dataclass(frozen=True)
class Plan:
    name: str
    # 1. overhead: conversations of hit_turns turns per cell (at least hit_min_convs, 2 per
    # client) at each of hit_clients, JSON and streamed, in alternating rounds of every arm
    overhead_rounds: int
    hit_clients: tuple[int, ...]
    hit_min_convs: int
    hit_turns: int
    # 2. throughput: open-loop rate sweep
    sweep_start: float
    sweep_factor: float
    sweep_steps: int
    sweep_step_s: float
    # 3. reuse: multi-turn conversations
    conv_n: int
    conv_turns: int
    conv_concurrency: int
    conv_rounds: int  # the arms take turns, round by round, each with conv_n / rounds chats
    system_words: tuple[int, int]
    user_words: tuple[int, int]
    output_tokens: tuple[int, int]
    ample_blocks: int
    small_prefill_blocks: int
    max_model_len: int
    # 5. profile (0: skipped)
    profile_s: float
    # 6. KV events: conversations x turns per router per round, with and without events
    events_convs: int
    events_turns: int
    events_rounds: int
    # 2, hits: closed-loop concurrencies of section 1's conversations against the pinned
    # router, and conversations per level (at least 2 per client)
    hit_tput_clients: tuple[int, ...]
    hit_tput_convs: int
    # 7. D's memory: conversations arriving per second for pins_s seconds on a D of
    # pins_blocks blocks (the engine's own 480 s pin TTL), releases on and off
    pins_rate: float
    pins_s: float
    pins_blocks: int
    pins_timeout_s: float  # a client gives up on a turn after this long
    pins_window_s: float  # the time series' step
    # 8. peers: section 7's arrivals for peers_s seconds per arm and round (the variants
    # for a share of it; bench/peers.py, SCENARIOS)
    peers_s: float
    gpu: GpuProfile = GpuProfile()

    @property
    def quick(self) -> bool:
        return self.name == "quick"


FULL = Plan(
    name="full",
    overhead_rounds=4,
    hit_clients=(1, 16, 128),
    hit_min_convs=24,
    hit_turns=5,
    sweep_start=100.0,
    sweep_factor=1.35,
    sweep_steps=12,
    sweep_step_s=4.0,
    conv_n=64,
    conv_turns=8,
    conv_concurrency=16,
    conv_rounds=2,
    system_words=(1000, 4000),
    user_words=(100, 300),
    output_tokens=(100, 500),
    ample_blocks=65536,
    small_prefill_blocks=1536,
    max_model_len=16384,
    profile_s=12.0,
    events_convs=10,
    events_turns=6,
    events_rounds=4,
    hit_tput_clients=(16, 64),
    hit_tput_convs=800,
    pins_rate=3.0,
    pins_s=150.0,
    pins_blocks=8192,
    pins_timeout_s=30.0,
    pins_window_s=10.0,
    peers_s=60.0,
)

QUICK = Plan(
    name="quick",
    overhead_rounds=1,
    hit_clients=(1, 16),
    hit_min_convs=4,
    hit_turns=3,
    sweep_start=100.0,
    sweep_factor=2.0,
    sweep_steps=3,
    sweep_step_s=0.6,
    conv_n=8,
    conv_turns=3,
    conv_concurrency=8,
    conv_rounds=1,
    system_words=(800, 1200),
    user_words=(30, 60),
    output_tokens=(30, 40),  # at 7.5 ms per token: the reuse arms in seconds
    ample_blocks=8192,
    small_prefill_blocks=257,
    max_model_len=4096,
    profile_s=0.0,
    events_convs=3,
    events_turns=4,
    events_rounds=2,
    hit_tput_clients=(8,),
    hit_tput_convs=16,
    pins_rate=3.0,
    pins_s=10.0,
    pins_blocks=1024,  # D fills within the run: its pressure releases show
    pins_timeout_s=5.0,
    pins_window_s=3.0,
    peers_s=6.0,
)

"""vllm-router's command-line spellings in `kvbaton serve`: those that mean the same thing are
accepted, the others refused with kvbaton's equivalent named (docs/migrating.md, "Coming from
vllm-router", says which is which, flag by flag, and a test holds the two to each other)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from router.errors import ConfigError

# vllm-router's flags kvbaton has no spelling of, and what to write instead.
_NO_POLICY = (
    "kvbaton has no policy to choose: a conversation stays on the P and D that hold its KV "
    "and new ones go by health and load; for placement by what engines hold, give --kv-events"
)
_NONE = "kvbaton has no equivalent: drop it"
REFUSED: dict[str, str] = {
    "--api-key": "the key sent to the engines is --engine-api-key",
    "-V": "kvbaton's version is --version",
    "--policy": _NO_POLICY,
    "--prefill-policy": _NO_POLICY,
    "--decode-policy": _NO_POLICY,
    **dict.fromkeys(
        (
            "--cache-threshold",
            "--balance-abs-threshold",
            "--balance-rel-threshold",
            "--eviction-interval",
            "--eviction-interval-secs",
            "--max-tree-size",
        ),
        "kvbaton keeps no approximate prefix tree: it learns what each engine holds from "
        "--kv-events (at most --kv-index-max-blocks per engine)",
    ),
    "--worker-urls": "kvbaton routes P/D only: list the engines with --prefill and --decode",
    "--intra-node-data-parallel-size": "give each engine's size with --data-parallel-size URL=N",
    "--vllm-discovery-address": (
        "MoRI-IO instances announce themselves to --moriio-register tcp://HOST:PORT; other "
        "instances are listed with --prefill and --decode, or added by POST /instances/add"
    ),
    **dict.fromkeys(
        (
            "--service-discovery",
            "--selector",
            "--service-discovery-port",
            "--service-discovery-namespace",
            "--prefill-selector",
            "--decode-selector",
        ),
        "give --prefill and --decode a headless Service's host name and --resolve-dns: each "
        "address it resolves to is an instance",
    ),
    **dict.fromkeys(
        ("--worker-startup-timeout-secs", "--worker-startup-check-interval"),
        "kvbaton does not wait for the engines to start: it probes them every --health-interval",
    ),
    "--max-payload-size": "the largest request body is --max-body-bytes",
    "--request-timeout-secs": (
        "kvbaton times each leg: --prefill-timeout, --decode-first-byte-timeout and "
        "--decode-idle-timeout"
    ),
    **dict.fromkeys(
        (
            "--retry-max-retries",
            "--retry-initial-backoff-ms",
            "--retry-max-backoff-ms",
            "--retry-backoff-multiplier",
            "--retry-jitter-factor",
            "--disable-retries",
        ),
        "kvbaton's retries are the turn's own (a failed P leg goes to another P, a D that "
        "fails before its first byte is replaced); an instance is ejected after "
        "--unhealthy-after failures",
    ),
    **dict.fromkeys(
        (
            "--cb-failure-threshold",
            "--cb-success-threshold",
            "--cb-timeout-duration-secs",
            "--cb-window-duration-secs",
            "--disable-circuit-breaker",
            "--health-failure-threshold",
            "--health-success-threshold",
            "--health-check-timeout-secs",
            "--health-check-interval-secs",
            "--health-check-endpoint",
        ),
        "an instance is ejected after --unhealthy-after consecutive failures, and re-admitted "
        "when its /health answers again, probed every --health-interval",
    ),
    "--log-dir": "kvbaton logs to stderr, one JSON object a line with --log-format json",
    **dict.fromkeys(
        ("--prometheus-port", "--prometheus-host"),
        "the metrics are at GET /metrics on the router's own --host and --port",
    ),
    "--request-id-headers": (
        "kvbaton gives each turn its own X-Request-Id, sent to both legs and returned"
    ),
    **dict.fromkeys(
        ("--enable-trace", "--otlp-traces-endpoint"),
        "tracing is on with --otel-endpoint URL (OTLP/HTTP)",
    ),
    **dict.fromkeys(
        ("--api-key-validation-urls",),
        "kvbaton checks no client keys: it scopes conversations by the bearer token, or by "
        "--tenant-header",
    ),
    **dict.fromkeys(
        (
            "--backend",
            "--runtime",
            "--max-concurrent-requests",
            "--queue-size",
            "--queue-timeout-secs",
            "--rate-limit-tokens-per-second",
            "--cors-allowed-origins",
            "--otel-sampling-ratio",
            "--otel-excluded-paths",
            "--mini-lb",
            "--enable-igw",
            "--history-backend",
            "--profile",
            "--enable-program-scheduling",
            "--program-scheduling-config-json",
            "--wasm-middleware",
            "--wasm-middleware-sha256",
            "--wasm-middleware-route",
        ),
        _NONE,
    ),
}
# kvbaton always routes P then D: vllm-router's switch for that mode changes nothing here.
ACCEPTED = ("--vllm-pd-disaggregation",)
# --kv-connector values of vllm-router's that kvbaton does not speak.
REFUSED_CONNECTORS = {
    "mooncake": (
        "vLLM's MooncakeConnector (transfer ids, a bootstrap port on P) is not one kvbaton "
        "speaks; run the engines with NixlConnector (--kv-connector nixl, with D->P reuse) or "
        "MooncakeStoreConnector (--kv-connector store)"
    ),
}


class _Refused(argparse.Action):
    def __init__(self, *args: Any, advice: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.advice = advice

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ConfigError(f"{self.option_strings[0]} is vllm-router's: {self.advice}")


class _Ignored(argparse.Action):
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        pass


class PrefillUrls(argparse.Action):
    """`--prefill URL...`, repeatable; vllm-router's `--prefill URL none` (no bootstrap port)
    is URL, and a bootstrap port is refused: no connector kvbaton speaks takes one."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        urls = list(getattr(namespace, self.dest) or ())
        for value in values or ():
            if value.lower() == "none":
                continue
            if value.isdigit():
                after = f" {urls[-1]}" if urls else ""
                raise ConfigError(
                    f"--prefill{after} {value}: {value} is a bootstrap port (vllm-router's "
                    f"--prefill URL BOOTSTRAP_PORT, for vLLM's MooncakeConnector); kvbaton's "
                    f"connectors take none: write --prefill{after or ' URL'}"
                )
            urls.append(value)
        setattr(namespace, self.dest, urls)


def add_to(parser: argparse.ArgumentParser) -> None:
    """vllm-router's flags on `kvbaton serve`'s parser, out of its help."""
    for flag in ACCEPTED:
        parser.add_argument(
            flag, nargs=0, action=_Ignored, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    for flag, advice in REFUSED.items():
        parser.add_argument(
            flag,
            nargs="*",
            action=_Refused,
            advice=advice,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def check_values(argv: Sequence[str]) -> None:
    """Refuse, before argparse's "invalid choice", the values of kvbaton's own flags that
    only vllm-router takes, naming what to write instead."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == "--kv-connector":
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value in REFUSED_CONNECTORS:
                raise ConfigError(f"--kv-connector {value}: {REFUSED_CONNECTORS[value]}")

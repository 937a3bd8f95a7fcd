"""docs/migrating.md's "Coming from vllm-router" is what `kvbaton serve` does: each vllm-router
flag in its table is accepted, or refused with one line naming the kvbaton flags the table
names, and every vllm-router flag the parser knows is in the table. One real router started
with `--prefill` once per P serves both."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.procs import SimProc, sim
from harness.router import router
from router import vllm_router_flags
from router.config import FLAGS, build_parser, load_settings
from router.errors import ConfigError
from tests.ops.conftest import BIDIR, call, chat

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
BASE = ["--prefill", "http://p0:8000", "--decode", "http://d0:8001"]


def section() -> str:
    text = DOC.read_text()
    start = text.index("## Coming from vllm-router")
    return text[start : text.index("\n## ", start + 1)]


@dataclass(frozen=True)
class Row:
    uses: tuple[str, ...]  # vllm-router command-line fragments, e.g. "--policy cache_aware"
    accepted: bool
    instead: tuple[str, ...]  # the kvbaton flags a refusal must name

    @property
    def flags(self) -> set[str]:
        return {use.split()[0] for use in self.uses}


def rows() -> list[Row]:
    found = []
    for line in section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        verdict = cells[1]
        assert verdict.startswith(("accepted", "refused")), line
        named = " ".join(re.findall(r"`([^`]+)`", verdict))
        instead = tuple(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", named))
        uses = tuple(re.findall(r"`([^`]+)`", cells[0]))
        found.append(Row(uses, verdict == "accepted", instead))
    return found


ROWS = rows()
USES = [(use, row) for row in ROWS for use in row.uses]


def test_the_table_is_there() -> None:
    assert len(ROWS) >= 25
    assert sum(len(row.uses) for row in ROWS) >= 60


@pytest.mark.parametrize(("use", "row"), USES, ids=[use for use, _ in USES])
def test_each_flag_is_accepted_or_refused_as_the_doc_says(
    use: str, row: Row, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*BASE, *shlex.split(use)]
    if row.accepted:
        try:
            load_settings(argv, env={})
        except SystemExit as exc:  # --help, --version
            assert exc.code == 0, use
            assert capsys.readouterr().out
        return
    with pytest.raises(ConfigError) as refused:
        load_settings(argv, env={})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(use.split()[0] if use.split()[0] != "--prefill" else use), message
    for flag in row.instead:
        assert flag in message, f"{use}: the refusal does not name {flag}: {message}"
    if not row.instead:
        assert "no equivalent" in message or "X-Request-Id" in message, message


def test_every_vllm_router_flag_the_parser_knows_is_in_the_table() -> None:
    documented = set().union(*(row.flags for row in ROWS))
    known = set(vllm_router_flags.REFUSED) | set(vllm_router_flags.ACCEPTED)
    assert known <= documented, f"not in docs/migrating.md: {sorted(known - documented)}"
    ours = {"--" + f.name.replace("_", "-") for f in FLAGS} | {"--help", "--version"}
    assert documented <= known | ours, f"not known to the parser: {documented - known - ours}"


def test_vllm_router_spellings_stay_out_of_the_usage() -> None:
    text = build_parser().format_usage()
    for flag in vllm_router_flags.REFUSED | dict.fromkeys(vllm_router_flags.ACCEPTED):
        assert not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), flag


def test_the_sections_kvbaton_command_starts_with_both_prefills() -> None:
    """The vllm-router command rewritten for kvbaton, as the doc prints it, parses to every P
    and D it names."""
    block = re.search(r"```bash\n(?:export [^\n]*\n)?(kvbaton serve .*?)```", section(), re.S)
    assert block, "no kvbaton serve example"
    argv = shlex.split(block.group(1).replace("\\\n", " "))[2:]
    settings = load_settings(argv, env={})
    assert settings.prefill == ("http://prefill-1:8000", "http://prefill-2:8000")
    assert settings.decode == ("http://decode-1:8001", "http://decode-2:8001")
    assert (settings.host, settings.port) == ("0.0.0.0", 8090)


def test_bootstrap_ports_as_vllm_router_parses_them() -> None:
    """`none` in any case is no port; a port is refused wherever it stands, naming its URL."""
    argv = ["--prefill", "http://p1:1", "NONE", "http://p2:1", "none", "--decode", "d:1"]
    assert load_settings(argv, env={}).prefill == ("http://p1:1", "http://p2:1")
    with pytest.raises(ConfigError, match=r"^--prefill http://p2:1 9001: .*--prefill http://p2:1$"):
        load_settings(["--prefill", "http://p1:1", "http://p2:1", "9001", *BASE[2:]], env={})
    with pytest.raises(ConfigError, match=r"write --prefill URL$"):
        load_settings(["--prefill", "9000", *BASE[2:]], env={})
    with pytest.raises(ConfigError, match="at least one --prefill URL"):
        load_settings(["--prefill", "none", *BASE[2:]], env={})
    # The environment's list is kvbaton's own: no vllm-router forms there.
    env = {"KVBATON_PREFILL": "http://p1:1 http://p2:1", "KVBATON_DECODE": "d:1"}
    assert load_settings([], env=env).prefill == ("http://p1:1", "http://p2:1")


@pytest.mark.e2e
def test_a_router_started_with_prefill_per_p_serves_both(p: SimProc, d: SimProc) -> None:
    """`--prefill P1 none ... --prefill P2`, vllm-router's way, on a real router: /status
    counts both P (before, only the last --prefill was kept) and turns are served."""
    with sim("prefill", *BIDIR, name="ops-vr-p2") as p2:
        extra = ("--prefill", p2.url, "--vllm-pd-disaggregation")
        with router([p.url, "none"], [d.url], *extra, name="ops-vllm-router") as r:
            status, body = call("GET", r.url + "/status", key=None)
            assert status == 200
            assert body["prefill_node_count"] == 2
            assert body["prefill_nodes"] == [p.url, p2.url]
            for i in range(4):  # new conversations: both P are in the pool
                assert chat(r.url, f"vllm-router-{i}", f"hello {i}")[0] == 200

"""DnsExpander as a table: names become one URL per address; failures keep what was known."""

from __future__ import annotations

import pytest

from router.engines.dns import DnsExpander, SystemResolver


class Answers:
    """A resolver whose answers the test sets (OSError: the name does not resolve)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[tuple[str, int]] | OSError] = {}
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int) -> list[tuple[str, int]]:
        self.asked.append(host)
        answer = self.answers[host]
        if isinstance(answer, OSError):
            raise answer
        return answer


async def test_a_name_expands_to_each_address_and_follows_changes() -> None:
    res = Answers()
    dns = DnsExpander(res)
    res.answers["d"] = [("10.0.0.2", 8200), ("10.0.0.1", 8200), ("10.0.0.2", 8200)]
    got = await dns.expand(["http://d:8200", "http://10.9.9.9:1", "https://[::1]:2/v"])
    assert got == (
        "http://10.0.0.1:8200",
        "http://10.0.0.2:8200",
        "http://10.9.9.9:1",
        "https://[::1]:2/v",
    )
    assert res.asked == ["d"]  # addresses are not looked up
    res.answers["d"] = [("10.0.0.3", 8200), ("fd00::5", 8200)]
    assert await dns.expand(["http://d:8200"]) == ("http://10.0.0.3:8200", "http://[fd00::5]:8200")
    assert dns.expanded == {"http://10.0.0.3:8200", "http://[fd00::5]:8200"}


@pytest.mark.parametrize("failure", [OSError("NXDOMAIN"), []])
async def test_a_failing_name_keeps_its_last_addresses_or_stays_a_name(failure: object) -> None:
    res = Answers()
    dns = DnsExpander(res)
    res.answers["p"] = failure  # type: ignore[assignment]
    assert await dns.expand(["http://p:8100"]) == ("http://p:8100",)
    res.answers["p"] = [("10.0.0.7", 8100)]
    assert await dns.expand(["http://p:8100"]) == ("http://10.0.0.7:8100",)
    res.answers["p"] = failure  # type: ignore[assignment]
    assert await dns.expand(["http://p:8100"]) == ("http://10.0.0.7:8100",)


async def test_the_system_resolver_answers_localhost() -> None:
    found = await SystemResolver().resolve("localhost", 8100)
    assert ("127.0.0.1", 8100) in found or ("::1", 8100) in found
    with pytest.raises(OSError):
        await SystemResolver().resolve("no-such-name.invalid", 1)

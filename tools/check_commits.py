"""Commit messages (issue 53): a subject of 72 characters or fewer, then a blank line before the
body. Checks one message (`--message-file`: the commit-msg hook in .githooks/) or every commit
after a base commit (`make lint`)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

MAX_SUBJECT = 72
# The commits up to this one keep their subjects: before issue 53 the subject line carried the
# whole change (median 127 characters, 153 over 200). Every commit after it is checked.
BASE = "8432a92"
SCISSORS = "# ------------------------ >8 ------------------------"


def problem(message: str) -> str | None:
    """Why `message`, as git stores it, breaks the rule (None: it keeps it)."""
    lines = message.splitlines()
    if not lines:
        return None  # git refuses an empty message itself
    subject = lines[0].rstrip()
    if len(subject) > MAX_SUBJECT:
        return f"the subject has {len(subject)} characters, over {MAX_SUBJECT}"
    if len(lines) > 1 and lines[1].strip():
        return "the second line is not blank (one blank line goes between subject and body)"
    return None


def edited(text: str) -> str:
    """The message git stores from the file a commit-msg hook gets: without its comment lines
    (and what `git commit -v` puts under the scissors line) and leading blank lines."""
    kept = [line for line in text.split(SCISSORS)[0].splitlines() if not line.startswith("#")]
    while kept and not kept[0].strip():
        kept.pop(0)
    return "\n".join(kept)


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=False)


def commits_after(base: str) -> list[tuple[str, str]] | str:
    """(short hash, message) of each commit reachable from HEAD and not from `base`; or why
    they cannot be listed here."""
    try:
        inside = git("rev-parse", "--is-inside-work-tree")
    except FileNotFoundError:
        return "git is not installed"
    if inside.returncode != 0:
        return "not in a git work tree"
    if git("cat-file", "-e", f"{base}^{{commit}}").returncode != 0:
        return f"the base commit {base} is not in this clone (a shallow clone?)"
    log = git("log", "-z", "--format=%h%n%B", f"{base}..HEAD")
    if log.returncode != 0:
        return f"git log failed: {log.stderr.strip()}"
    records = (record.partition("\n") for record in log.stdout.split("\0") if record)
    return [(sha, message) for sha, _, message in records]


def check_history(base: str) -> int:
    commits = commits_after(base)
    if isinstance(commits, str):
        print(f"check_commits: {commits}: commit subjects not checked")
        return 0
    bad = [(sha, why, message) for sha, message in commits if (why := problem(message))]
    for sha, why, message in bad:
        print(f"{sha}: {why}: {message.splitlines()[0][:60]}...")
    if bad:
        print(
            f"check_commits: {len(bad)} of the {len(commits)} commits after {base} break the rule:"
            " reword them (git rebase -i); .githooks/commit-msg checks each new one"
        )
        return 1
    print(f"check_commits: every commit after {base} keeps the rule ({len(commits)} checked)")
    return 0


def check_file(path: str) -> int:
    with open(path, encoding="utf-8", errors="replace") as f:
        why = problem(edited(f.read()))
    if why:
        print(f"commit-msg: {why}; the message is kept in {path}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Commit subjects of 72 characters or fewer.")
    parser.add_argument("--message-file", help="check this message (the commit-msg hook)")
    parser.add_argument("--base", default=BASE, help=f"check the commits after this one ({BASE})")
    args = parser.parse_args(argv)
    return check_file(args.message_file) if args.message_file else check_history(args.base)


if __name__ == "__main__":
    sys.exit(main())

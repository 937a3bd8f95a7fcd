"""tools/check_commits.py and .githooks/commit-msg on a temporary git repository: a subject
over 72 characters, or a second line that is not blank, is named; a good commit is not; a
missing base commit (a shallow clone) skips the check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.procs import ROOT
from tools.check_commits import edited, problem

CHECKER = ROOT / "tools" / "check_commits.py"
LONG = "tests: " + " and ".join(["a subject that says what the body should say"] * 3)
# Git as a fresh user has it: no global or system config (hooks, templates, signing).
GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("message", "why"),
    [
        ("docs: one short line", None),
        ("docs: a subject\n\nThe why, and the numbers.\n", None),
        ("x" * 72 + "\n\nbody", None),
        ("x" * 73, "the subject has 73 characters, over 72"),
        ("docs: a subject\nthe body at once", "the second line is not blank"),
        ("", None),
    ],
)
def test_problem(message: str, why: str | None) -> None:
    found = problem(message)
    if why is None:
        assert found is None
    else:
        assert found is not None and found.startswith(why), found


@pytest.mark.unit
def test_the_hook_reads_the_message_git_will_store() -> None:
    text = "\n\ndocs: a subject\n# Please enter the commit message\n\nbody\n"
    verbose = text + "# ------------------------ >8 ------------------------\n+a diff line\n"
    assert edited(text) == edited(verbose) == "docs: a subject\n\nbody"


def git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True)


def commit(repo: Path, message: str) -> str:
    done = git(repo, "commit", "--allow-empty", "-q", "-m", message)
    assert done.returncode == 0, done.stderr
    return git(repo, "rev-parse", "--short", "HEAD").stdout.strip()


def check(repo: Path, base: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **GIT_ENV}
    cmd = [sys.executable, str(CHECKER), "--base", base]
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=30)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    assert git(tmp_path, "init", "-q").returncode == 0
    return tmp_path


def test_the_commits_after_the_base_are_checked(repo: Path) -> None:
    commit(repo, LONG)  # before the base: kept as it is
    base = commit(repo, "the base")
    good = commit(repo, "docs: a short subject\n\nThe why, in the body.")
    long = commit(repo, LONG)
    run = check(repo, base)
    assert run.returncode == 1, run.stdout
    *named, summary = run.stdout.splitlines()
    assert named == [f"{long}: the subject has {len(LONG)} characters, over 72: {LONG[:60]}..."]
    assert summary.startswith(f"check_commits: 1 of the 2 commits after {base} break the rule")
    git(repo, "reset", "-q", "--hard", good)
    run = check(repo, base)
    assert run.returncode == 0 and "every commit after" in run.stdout, run.stdout


def test_a_clone_without_the_base_skips_the_check(repo: Path) -> None:
    commit(repo, LONG)
    run = check(repo, "8432a92")
    assert run.returncode == 0, run.stdout
    assert "not in this clone" in run.stdout and "not checked" in run.stdout


def test_the_hook_refuses_a_long_subject_and_keeps_a_good_one(repo: Path) -> None:
    git(repo, "config", "core.hooksPath", str(ROOT / ".githooks"))
    refused = git(repo, "commit", "--allow-empty", "-q", "-m", LONG)
    assert refused.returncode == 1
    assert refused.stderr.strip().startswith("commit-msg: the subject has"), refused.stderr
    glued = git(repo, "commit", "--allow-empty", "-q", "-m", "docs: a subject\nand the body")
    assert glued.returncode == 1 and "second line is not blank" in glued.stderr
    kept = git(repo, "commit", "--allow-empty", "-q", "-m", "docs: a subject\n\nThe why.")
    assert kept.returncode == 0, kept.stderr
    assert git(repo, "log", "--format=%s").stdout.splitlines() == ["docs: a subject"]

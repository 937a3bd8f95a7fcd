"""What section 8's peers run from outside the project: vllm-router from PyPI and files of a
fetched vLLM tree, in their own venv (`.venv-peers`, git-ignored) and a scratch folder; never
copied into the project."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.procs import ROOT

VLLM_ROUTER = "vllm-router==0.1.17"
PEERS_VENV = ROOT / ".venv-peers"
VLLM_TREE_ENV = "KVBATON_VLLM_TREE"
VLLM_MIRROR = "/work/.mirror/eigen-hub+vllm/repo"


def vllm_router() -> str | None:
    """vllm-router's executable, installed into .venv-peers on first use; None (and one line
    saying why) where it cannot be installed."""
    exe = PEERS_VENV / "bin" / "vllm-router"
    if exe.exists():
        return str(exe)
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", str(PEERS_VENV)], check=True, capture_output=True
        )
        subprocess.run(
            [str(PEERS_VENV / "bin" / "pip"), "install", "-q", VLLM_ROUTER],
            check=True,
            capture_output=True,
            timeout=600,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        print(
            f"peers: vllm-router arms skipped: `pip install {VLLM_ROUTER}` failed ({exc}; "
            f"{detail.decode(errors='replace').strip()[-200:]})",
            file=sys.stderr,
        )
        return None
    return str(exe)


def vllm_tree() -> Path:
    """The vLLM tree to copy from: $KVBATON_VLLM_TREE (a checkout or a git directory), else
    the search tool's mirror of vLLM when it was fetched here."""
    return Path(os.environ.get(VLLM_TREE_ENV) or VLLM_MIRROR)


def tree_file(path: str) -> bytes:
    """One file of the vLLM tree (OSError or SubprocessError where it has none)."""
    tree = vllm_tree()
    if (tree / path).is_file():
        return (tree / path).read_bytes()
    show = ["git", "--git-dir", str(tree), "show", f"HEAD:{path}"]
    return subprocess.run(show, check=True, capture_output=True, timeout=60).stdout


def vllm_copy(paths: tuple[str, ...], deps: tuple[str, ...], what: str) -> Path | None:
    """Files of a fetched vLLM tree copied into a scratch folder (never into the project),
    with what they import installed into .venv-peers; the folder, or None (and one line
    saying why) without a tree."""
    scratch = Path(tempfile.gettempdir()) / "kvbaton-peers"
    try:
        texts = {Path(path).name: tree_file(path) for path in paths}
        scratch.mkdir(exist_ok=True)
        for name, text in texts.items():
            (scratch / name).write_bytes(text)
        if vllm_router() is None:  # the venv
            return None
        if deps:
            pip = [str(PEERS_VENV / "bin" / "pip"), "install", "-q", *deps]
            subprocess.run(pip, check=True, capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        print(
            f"peers: {what} skipped: no {paths[0]} from a vLLM tree at {vllm_tree()} "
            f"(set {VLLM_TREE_ENV}) or its dependencies did not install ({exc})",
            file=sys.stderr,
        )
        return None
    return scratch

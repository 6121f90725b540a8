"""The README's "From Python" examples, run as written against a live Ember (only the base
URL is changed to the test server's). Each `print(...)  # expected` line must print what
its comment says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.live_server import REPO, ServerProcess, server_env

README_URL = "http://127.0.0.1:8080"


def examples() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## From Python", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def expected_lines(code: str) -> list[str | None]:
    """Per print statement, in order, what its comment says it prints (None: no claim)."""
    claims: list[str | None] = []
    for line in code.splitlines():
        if line.startswith("print("):
            match = re.search(r"\)\s+#\s*(.+)$", line)
            claims.append(match.group(1).strip() if match else None)
    return claims


EXAMPLES = examples()


def test_the_readme_has_every_client() -> None:
    joined = "\n".join(EXAMPLES)
    for library in ("from openai import", "from langchain_openai import",
                    "from llama_index.embeddings.openai_like import", "import cohere",
                    "from huggingface_hub import", "from sie_sdk import"):
        assert library in joined, library


@pytest.mark.parametrize("code", EXAMPLES, ids=[c.split("\n", 1)[0] for c in EXAMPLES])
def test_example_runs_as_written(code: str, server: ServerProcess, request: pytest.FixtureRequest,
                                 tmp_path: Path) -> None:
    assert README_URL in code
    script = tmp_path / "example.py"
    script.write_text(code.replace(README_URL, server.url), encoding="utf-8")
    python = str(request.getfixturevalue("sie_python")) if "sie_sdk" in code else sys.executable
    # As a user runs it: online mode (huggingface_hub refuses even loopback when offline).
    env = {k: v for k, v in server_env().items() if k not in ("HF_HUB_OFFLINE",
                                                              "TRANSFORMERS_OFFLINE")}
    run = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    printed = run.stdout.splitlines()
    claims = expected_lines(code)
    assert len(printed) == len(claims), run.stdout
    for got, claim in zip(printed, claims, strict=True):
        if claim is not None:
            assert got == claim, (got, claim)

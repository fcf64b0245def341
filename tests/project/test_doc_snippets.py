"""Every ```python block of README.md and docs/guide.md runs as written.

Each block runs alone, in a fresh namespace, in this process: a block imports and
defines everything it uses, and no block relies on one before it. A test case is one
block, named ``FILE:LINE`` (the line of its opening fence); a block that raises fails
its case with that name, and its traceback shows the document's own lines.

An HTML comment on the line right before a block's fence says how it runs:

- ``<!-- snippet: requires MODULE [MODULE ...] -->``: the block needs optional packages
  (transformers, triton, ...). Each is taken with ``pytest.importorskip`` first, so
  the block is skipped only where that package is not installed: tests/skip_policy.py
  fails a skip of an installed one.
- ``<!-- snippet: one rank -->``: a ``parascan.distributed`` block written for
  ``torchrun``. It runs here as the only rank of a gloo process group: the environment
  variables torchrun would set (a free port on 127.0.0.1, rank 0 of 1); the group is
  destroyed after it.
- ``<!-- snippet: not run: REASON -->``: compiled, never run (for what this machine cannot
  run, such as a GPU). Each such block is listed in ``NOT_RUN`` with its reason, and a
  test fails when the documents and that list differ, so none goes unnoticed.

Any other ``<!-- snippet: ... -->`` comment, or one that does not stand right before a
python block, fails ``test_markers``. A block must leave no process group behind (other
than a one-rank block's, which the test destroys) and no transformers patch in place
(the test restores the originals and fails the block).

The blocks use small shapes. Most of the time goes to the first transformers block
(importing transformers, and every modeling module ``patch()`` covers) and to the first
call of each kind of op (torch imports its compiler's modules then), which the rest of
the suite pays anyway.
"""

from __future__ import annotations

import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/guide.md")

# The blocks that are compiled but never run: (document, first line of the block's
# code after its fence, stripped) -> the reason, as in the document's marker.
NOT_RUN: dict[tuple[str, str], str] = {}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # 1-based line of the opening fence
    source: str  # the code, dedented by the fence's indentation
    mode: str  # "run", "requires", "one rank" or "not run"
    argument: str  # the modules of "requires", the reason of "not run"

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def _mode(body: str) -> tuple[str, str]:
    """The marker's mode and argument, or ValueError for a marker this test does not know."""
    if body.startswith("requires ") and body[len("requires ") :].split():
        return "requires", body[len("requires ") :].strip()
    if body == "one rank":
        return "one rank", ""
    if body.startswith("not run:") and body[len("not run:") :].strip():
        return "not run", body[len("not run:") :].strip()
    raise ValueError(f"unknown snippet marker {body!r}")


def parse(document: str) -> tuple[list[Block], list[str]]:
    """The python blocks of ``document``, and the problems with its markers (a marker
    this test does not know, or one that stands before no python block)."""
    lines = (ROOT / document).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    used: set[int] = set()  # lines of markers that stand before a python block
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = i + 1
        while end < len(lines) and not (
            lines[end].startswith(indent) and lines[end].strip().startswith(fence)
        ):
            end += 1
        if opening["info"] in ("python", "py"):
            code = [
                line[len(indent) :] if line.startswith(indent) else line
                for line in lines[i + 1 : end]
            ]
            mode, argument = "run", ""
            marker = _MARKER.match(lines[i - 1]) if i > 0 else None
            if marker is not None:
                used.add(i - 1)
                try:
                    mode, argument = _mode(marker["body"])
                except ValueError as error:
                    problems.append(f"{document}:{i}: {error}")
            blocks.append(Block(document, i + 1, "\n".join(code) + "\n", mode, argument))
        i = end + 1
    for number, line in enumerate(lines):
        if _MARKER.match(line) and number not in used:
            problems.append(f"{document}:{number + 1}: a snippet marker before no python block")
    return blocks, problems


BLOCKS = [block for document in DOCUMENTS for block in parse(document)[0]]


def test_markers() -> None:
    problems = [problem for document in DOCUMENTS for problem in parse(document)[1]]
    assert not problems, "\n".join(problems)


def test_every_document_has_blocks() -> None:
    for document in DOCUMENTS:
        assert any(block.document == document for block in BLOCKS), document


def test_not_run_blocks_are_listed() -> None:
    """The blocks marked ``not run`` are exactly those in NOT_RUN, with the same reasons."""
    found = {
        (block.document, block.source.strip().splitlines()[0].strip()): block.argument
        for block in BLOCKS
        if block.mode == "not run"
    }
    assert found == NOT_RUN


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leftover_patches() -> list[str]:
    """What a block left patched in transformers (restoring the originals)."""
    module = sys.modules.get("parascan.integrations.transformers")
    if module is None:
        return []
    left = list(module.patched())
    if left:
        module.unpatch()
    return left


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_block_runs(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    # The code at its own line numbers, so that a traceback shows the document's lines.
    code = compile("\n" * block.line + block.source, str(ROOT / block.document), "exec")
    if block.mode == "not run":
        return
    if block.mode == "requires":
        for module in block.argument.split():
            pytest.importorskip(module)
    if block.mode == "one rank":
        for name, value in (
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", str(_free_port())),
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_WORLD_SIZE", "1"),
        ):
            monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    namespace = {"__name__": "__main__"}
    try:
        exec(code, namespace)
    except Exception as error:
        raise AssertionError(f"{block.name}: the block raised {error!r}") from error
    finally:
        torch.set_num_threads(threads)
        group_left = dist.is_available() and dist.is_initialized()
        if group_left:
            dist.destroy_process_group()
        patches = _leftover_patches()
    assert not (group_left and block.mode != "one rank"), (
        f"{block.name}: the block left a torch.distributed process group behind"
    )
    assert not patches, f"{block.name}: the block left transformers patched: {patches}"

"""The docs name only what exists. README.md, CHANGELOG.md and docs/**/*.md are scanned for
repository paths (``tierkv/...``, ``nvmeof/...``, ``tests/...``, ``tools/...``, ``configs/...``),
dotted names (``tierkv.store.api``, ``tierkv.workload.SyntheticMix``, ``nvmeof.host.connect``),
bare module file names in backticks (``wire.py``) and relative Markdown links; each must
resolve in this tree. A rename that leaves a doc behind fails here, with the file, line and
name of every stale mention. URLs are not paths and are left out; a ``<placeholder>`` in a
path stands for any name (``tests/rig/test_<yours>.py`` needs ``tests/rig/test_*.py``).

A name that is gone on purpose is written as a former name, inside ``(was ...)`` on one line:
"``tierkv/store/moves.py`` (was ``tierkv/plans.py``)". Former names must *not* exist, so a
changelog's renames are checked both ways.

Dotted names resolve as Python does: the longest importable module prefix, then ``getattr``
for the rest, so ``tierkv.store.api.Store.open`` is the method ``open`` of class ``Store`` in
module ``tierkv.store.api``. Only the CPU-side imports the test suite already needs are used.
The README's Python examples are run too, in a temporary directory."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("README.md", "CHANGELOG.md")
# a path starts at one of these top-level folders; a '/', word character, '.' or '-' before it
# means it is the tail of another path ($PWD/tools/..., /var/tmp/tierkv/...), not ours
PATH = re.compile(r"(?<![\w./$-])(?:tierkv|nvmeof|tests|tools|configs)/[\w./*<>-]*")
DOTTED = re.compile(r"(?<![\w./$-])(?:tierkv|nvmeof)(?:\.[A-Za-z_]\w*)+")
BARE_PY = re.compile(r"`(\w+\.py)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
FILE_SUFFIXES = (".md", ".py", ".toml", ".json", ".jsonl", ".sh", ".txt", ".lock", ".log", ".png")
CODE_TREES = ("tierkv", "nvmeof", "tests", "tools")
FORMER = re.compile(r"\(was ([^)]*)\)")


def doc_files() -> list[Path]:
    docs = [ROOT / name for name in REQUIRED if (ROOT / name).exists()]
    return docs + sorted((ROOT / "docs").rglob("*.md"))


def lines() -> Iterator[tuple[str, str, list[str]]]:
    """``(where, line, former)`` for every line of the docs: URLs blanked out, and the
    ``(was ...)`` spans taken out of the line into ``former``."""
    for doc in doc_files():
        for n, text in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            text = URL.sub(" ", text)
            former = FORMER.findall(text)
            yield f"{doc.relative_to(ROOT)}:{n}", FORMER.sub(" ", text), former


def mentions(pattern: re.Pattern[str], group: int = 0, *, former: bool = False) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for every match of ``pattern`` in the docs' current names, or in
    their former names with ``former=True``."""
    for where, line, was in lines():
        for text in (was if former else [line]):
            for m in pattern.finditer(text):
                yield where, m.group(group)


def path_exists(text: str, base: Path = ROOT) -> bool:
    """Whether ``text`` (relative to ``base``) names a file or folder here; ``<name>`` and ``*``
    match any name, but at least one thing must match."""
    text = text.rstrip(".").split("#")[0]
    if "<" in text or "*" in text:
        return any(base.glob(re.sub(r"<[^>]*>", "*", text)))
    return (base / text).exists()


def resolve(name: str) -> object:
    """The object ``name`` denotes: the longest importable module prefix, then attributes.
    Raises ``LookupError`` naming the part that does not exist. A module that exists but fails
    to import for another reason (a missing dependency) raises that error as it is."""
    parts = name.split(".")
    if "__main__" in parts:  # importing it would run a command
        raise LookupError(f"{name}: __main__ is not checked")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj: object = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue
            raise
        for j in range(i, len(parts)):
            if not hasattr(obj, parts[j]):
                raise LookupError(f"{'.'.join(parts[:j])} has no {parts[j]!r}")
            obj = getattr(obj, parts[j])
        return obj
    raise LookupError(f"no module {parts[0]!r}")


def code_file_names() -> set[str]:
    return {p.name for tree in CODE_TREES for p in (ROOT / tree).rglob("*.py")}


def report(stale: list[str]) -> str:
    return f"{len(stale)} stale mention(s) in the docs:\n  " + "\n  ".join(stale)


def test_the_docs_exist() -> None:
    for name in REQUIRED:
        assert (ROOT / name).is_file(), f"{name} is missing"
    assert len(doc_files()) > len(REQUIRED)


def test_every_repository_path_exists() -> None:
    stale = [f"{where}: {text}" for where, text in mentions(PATH) if not path_exists(text)]
    assert not stale, report(stale)


def test_every_dotted_name_resolves() -> None:
    stale = []
    for where, name in mentions(DOTTED):
        if name.endswith(FILE_SUFFIXES):  # a file name (tierkv.toml, nvmeof.md), not a module
            continue
        try:
            resolve(name)
        except LookupError as e:
            stale.append(f"{where}: {name} ({e})")
    assert not stale, report(stale)


def blocks() -> Iterator[list[tuple[str, str]]]:
    """The docs' lines, as from :func:`lines`, grouped into Markdown blocks: a paragraph, one
    list item, one table row or one heading, each a list of ``(where, line)``."""
    block: list[tuple[str, str]] = []
    for where, line, _ in lines():
        starts = re.match(r"\s*([-*+]|\d+\.)\s|\||#", line) is not None
        if block and (not line.strip() or starts or where.rsplit(":", 1)[0] != block[0][0].rsplit(":", 1)[0]):
            yield block
            block = []
        if line.strip():
            block.append((where, line))
    if block:
        yield block


def test_every_bare_module_file_exists() -> None:
    """`wire.py` alone does not say which folder it means. In a paragraph, list item or table
    row that names folders (`tierkv/rig/`) it must be in one of them; elsewhere it must at
    least name some file in tierkv/, nvmeof/, tests/ or tools/ (a renamed module's old name
    fails)."""
    names = code_file_names()
    stale = []
    for block in blocks():
        text = "\n".join(line for _, line in block)
        folders = [ROOT / p for p in PATH.findall(text) if p.endswith("/") and (ROOT / p).is_dir()]
        inside = " or ".join(str(f.relative_to(ROOT)) + "/" for f in folders) or "the code"
        for where, line in block:
            for name in BARE_PY.findall(line):
                if not (any((f / name).is_file() for f in folders) if folders else name in names):
                    stale.append(f"{where}: {name} (not in {inside})")
    assert not stale, report(stale)


def test_former_names_are_gone() -> None:
    """A name written as ``(was ...)`` must not exist any more: the rename really happened."""
    alive = [f"{where}: {text} still exists" for where, text in mentions(PATH, former=True) if path_exists(text)]
    for where, name in mentions(DOTTED, former=True):
        try:
            resolve(name)
        except LookupError:
            continue
        alive.append(f"{where}: {name} still resolves")
    assert not alive, report(alive)


def readme_examples() -> list[tuple[str, str]]:
    """``(heading, code)`` of every ```python block in README.md, under the heading it follows."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    examples, heading = [], ""
    for part in re.split(r"(?m)^(## .*)$", readme):
        if part.startswith("## "):
            heading = part[3:].strip()
            continue
        examples += [(heading, code) for code in re.findall(r"```python\n(.*?)```", part, re.S)]
    return examples


@pytest.mark.parametrize(("heading", "code"), [pytest.param(h, c, id=h) for h, c in readme_examples()])
def test_the_readme_examples_run(heading: str, code: str, tmp_path: Path) -> None:
    """Each README example runs with this checkout on the path and its store under ``tmp_path``.
    Sizes written in GiB run in MiB and a quoted absolute store path becomes ``tmp_path``, so
    production-sized examples run in seconds; the quickstart needs neither. An API rename that
    leaves an example behind fails here. A printed ``True``/``False`` is the example's own check."""
    small = re.sub(r'"(\d+)GiB"', r'"\1MiB"', code)
    small = re.sub(r'(?<=path=)"/[^"]*"', repr(str(tmp_path / "store")), small)
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", small], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"README example under '## {heading}':\n{run.stderr}"
    assert "False" not in run.stdout.split(), run.stdout


def test_the_readme_has_a_quickstart_example() -> None:
    assert any(heading.startswith("Quickstart") for heading, _ in readme_examples())


def test_every_relative_link_resolves() -> None:
    stale = []
    for doc in doc_files():
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL or an anchor in this page
                if not path_exists(target, doc.parent):
                    stale.append(f"{doc.relative_to(ROOT)}:{n}: {target}")
    assert not stale, report(stale)


# the scanner itself


@pytest.mark.parametrize(("line", "found"), [
    ("see `tierkv/store/moves.py` and tests/tiers/.", ["tierkv/store/moves.py", "tests/tiers/."]),
    ("run tools/install.sh && tools/test.sh", ["tools/install.sh", "tools/test.sh"]),
    ("$PWD/tools/peers_tierkv.py, /var/tmp/tierkv/x, ../shared/tests/a.py", []),
    ("https://github.com/o/r/blob/main/tierkv/x.py", []),
])
def test_paths_are_found_and_urls_left_out(line: str, found: list[str]) -> None:
    assert [m.group(0) for m in PATH.finditer(URL.sub(" ", line))] == found


def test_placeholders_and_missing_paths() -> None:
    assert path_exists("tests/rig/test_<yours>.py") and path_exists("tests/*/conftest.py")
    assert path_exists("tierkv/store/") and path_exists("tierkv/store/moves.py.")
    assert not path_exists("tierkv/plans.py") and not path_exists("tests/nothing/<x>.py")


def test_dotted_names_resolve_to_modules_then_attributes() -> None:
    from tierkv.store import api

    assert resolve("tierkv.store.api") is api
    assert resolve("tierkv.store.api.Store.open") == api.Store.open  # a classmethod: a new bound method each time
    assert [m.group(0) for m in DOTTED.finditer("`tierkv.x.Y`, peers_tierkv.py, /a/tierkv.z")] == ["tierkv.x.Y"]
    for stale in ("tierkv.plans", "tierkv.store.api.Nothing", "tierkv.store.nothing.Store"):
        with pytest.raises(LookupError):
            resolve(stale)


def test_former_names_are_taken_out_of_the_line() -> None:
    line = "- `tierkv/store/coding.py` (was `tierkv/store_codec.py`), `tierkv.store.moves.MovePlan` (was `tierkv.plans.Plan`)"
    assert FORMER.findall(line) == ["`tierkv/store_codec.py`", "`tierkv.plans.Plan`"]
    assert PATH.findall(FORMER.sub(" ", line)) == ["tierkv/store/coding.py"]
    assert DOTTED.findall(FORMER.sub(" ", line)) == ["tierkv.store.moves.MovePlan"]

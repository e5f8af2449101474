"""``tierkv bench scale`` (issue 20): run as a user runs it, at 2,000 pages instead of a
million. Every figure the issue names is in the JSON, a finite number of the right sign,
for the store and for the dict measured beside it in the same run, and the run checked
itself (every page stored and found, the timed puts and gets in the DRAM tier, the bytes
back as put). Bad ``--pages`` is one line naming what was expected, and exit status 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tierkv.bench.scale import MAX_PAGES, check_pages
from tierkv.cli.exits import EXIT_OK, EXIT_USAGE
from tierkv.cli.main import main
from tierkv.errors import InputError

#: The figures issue 20 names, for the store and for its dict reference.
FIGURES = ("bytes_per_page_entry", "reopen_s_per_million_pages", "put_us_per_page", "get_us_per_page",
           "lookup_us_per_page")
#: Memory growth over 2,000 pages may round to nothing for a table allocated up front; times may not.
MAY_BE_ZERO = {"bytes_per_page_entry", "reopen_bytes_per_page_entry", "anon_bytes_per_page_entry"}


def _number(figures: dict[str, object], key: str) -> float:
    value = figures.get(key)
    assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{key}: {value!r} is not a number"
    assert math.isfinite(value), f"{key}: {value} is not finite"
    assert value > 0 or (key in MAY_BE_ZERO and value == 0), f"{key}: {value} is not positive"
    return float(value)


def test_scale_prints_every_figure_for_the_store_and_the_dict(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scale", "--pages", "2000", "--json", "--dir", str(tmp_path)]) == EXIT_OK
    r = json.loads(capsys.readouterr().out)
    assert r["pages"] == 2000 and r["page_bytes"] == 4096 and r["dram_pages"] == 20
    for key in (*FIGURES, "reopen_bytes_per_page_entry", "anon_bytes_per_page_entry", "reopen_s",
                "load_us_per_page", "copy_us_per_page", "table_bytes_per_page", "index_file_bytes_per_page"):
        _number(r, key)
    from tierkv.policy.leaves import native_available

    assert (r["policy_bytes_per_page"] is None) == (not native_available())
    ref = r["dict"]
    assert isinstance(ref, dict)
    for key in (*FIGURES, "key_chain_us_per_page"):
        _number(ref, key)
    assert ref["bytes_per_page_entry"] > 0  # the dict keeps its 2,000 keys and tuples
    assert set(r["store_vs_dict"]) == set(FIGURES)
    for key in FIGURES:
        if r[key] > 0:
            assert r["store_vs_dict"][key] == pytest.approx(r[key] / ref[key])
    assert r["pages_stored"] == r["pages_found"] == 2000
    assert r["put_pages_timed"] == r["timed_put_into_dram"] == 20 and r["timed_put_evictions"] == 0
    assert r["get_pages_timed"] >= 65_536 and r["timed_gets_from_dram"] is True and r["bytes_match"] is True
    assert r["verified"] is True
    from tierkv.bench.scale import REOPEN_ROUNDS, ROUND_FIGURES, WARM_FILLS

    assert r["reopen_rounds"] == REOPEN_ROUNDS and r["nvme_pages"] == 2000 + (WARM_FILLS + REOPEN_ROUNDS) * 20
    for key in ROUND_FIGURES:   # each round's figure, and their median
        if key != "reopen_s":
            runs = r[f"{key}_runs"]
            assert len(runs) == REOPEN_ROUNDS and r[key] == sorted(runs)[REOPEN_ROUNDS // 2]
    assert set(r["timed"]) >= set(FIGURES), "each figure says what it times"
    assert list(tmp_path.iterdir()) == [], "the store's files are removed"


def test_scale_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scale", "--pages", "300", "--dir", str(tmp_path)]) == EXIT_OK
    out = capsys.readouterr().out
    for text in ("the page table at 300 pages", "store / dict", "get µs per page (DRAM hits)", "what is measured",
                 "verified"):
        assert text in out


@pytest.mark.parametrize("pages, shown", [("0", "0"), ("-5", "-5"), ("abc", "'abc'"), ("1.5", "'1.5'"),
                                          ("2e3", "'2e3'"), ("", "''"), (str(MAX_PAGES + 1), f"{MAX_PAGES + 1:,}")])
def test_bad_pages_is_one_line_and_exit_2(pages: str, shown: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scale", "--pages", pages, "--json", "--dir", str(tmp_path)]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"tierkv: error: --pages: expected a whole number of pages from 1 to {MAX_PAGES:,}, "
                            f"got {shown}\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["bench", "store", "--pages", "10"], "--pages is for the scale, cluster and dualpath suites, not store"),
    (["bench", "scale", "--pages", "10", "--runs", "2"], "--runs is not for the scale suite"),
])
def test_options_of_other_suites_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--json"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_check_pages() -> None:
    assert check_pages("2000") == check_pages(2000) == 2000
    assert check_pages("1_000_000") == 1_000_000
    for bad in (True, 2.0, None, 0):
        with pytest.raises(InputError, match="^--pages: expected a whole number of pages"):
            check_pages(bad)

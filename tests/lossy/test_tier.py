"""A lossy tier (tierkv.store.lossy_tier): exact pages that come down into an NVMe tier
configured with ``lossy_bits`` are converted in the background to lossy pages at that
budget, which exact gets no longer see and gets that accept the budget decode to exactly
what the format decodes; put_lossy's pages are left as they are; pages with cached
children or pins wait; the queue survives a clean close; real LMDB and O_DIRECT files."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tierkv.config import DramConfig, NvmeConfig, NvmeofConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.layout import KVLayout
from tierkv.lossy.alloc import Calibration, allocate
from tierkv.lossy.format import decode, encode
from tierkv.store.api import Store
from tierkv.store.lossy_pages import from_float, to_float
from tierkv.store.lossy_tier import PENDING_FILE
from tierkv.tiers.base import TierId, TierKind

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=64)
TPP, PB = 64, LAYOUT.page_bytes
BITS = 4.0


def pages(seed: int, n: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, *LAYOUT.page_shape)).astype(np.float32)
    return np.stack([from_float(p, "bf16") for p in x])


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n * TPP).astype(np.uint32)


def config(path: Path, dram_pages: int = 2, policy: str = "gittins", **nvme: object) -> StoreConfig:
    opts: dict[str, object] = {"codec": "lossless", "lossy_bits": BITS, **nvme}
    return StoreConfig(path=str(path), model_id="lossy-tier", layout=LAYOUT, dram=DramConfig(dram_pages * PB),
                       nvme=NvmeConfig(64 * PB, **opts), policy=policy)  # type: ignore[arg-type]


def converted(raw: np.ndarray, cal: Calibration | None = None, evict: bool = False) -> np.ndarray:
    """What the tier's conversion decodes to: flat importance, no eviction (``evict``:
    what put_lossy stores without an importance)."""
    out = []
    for row in raw:
        page = to_float(row[None], "bf16", LAYOUT.page_shape)[0]
        out.append(from_float(decode(encode(page, allocate(page, BITS, None, cal, evict=evict), "bf16",
                                            BITS)).page, "bf16"))
    return np.stack(out)


def settle(s: Store, timeout_s: float = 30.0) -> None:
    """Until the tier has converted everything, kept-back pages included."""
    deadline = time.monotonic() + timeout_s
    while s.wait_converted(1.0) or s.stats().lossy_pending or s.stats().lossy_waiting:
        st = s.stats()
        assert time.monotonic() < deadline, f"{st.lossy_pending} pages queued, {st.lossy_waiting} kept back"


def test_pages_that_come_down_are_converted_and_served_only_as_lossy(tmp_path: Path) -> None:
    n = 8
    toks, raw = tokens(1, n), pages(1, n)
    with Store.open(config(tmp_path / "s")) as s:
        s.put(toks, raw)                 # 2 pages fit the DRAM tier, 6 go to the NVMe tier
        settle(s)
        st = s.stats()
        assert (st.lossy_converted, st.lossy_pending, st.lossy_waiting) == (6, 0, 0)
        assert s.lookup(toks).cached_pages == 2              # the exact pages end where DRAM's do
        look = s.lookup(toks, accept_lossy=BITS)
        assert (look.cached_pages, look.lossy) == (n, 6)
        assert s.lookup(toks, accept_lossy=2.0).cached_pages == 2
        out = np.zeros((n, PB), np.uint8)
        got = s.get(toks, out, accept_lossy=BITS)
        assert (got.pages, got.lossy) == (n, 6) and got.evicted is not None and not got.evicted.any()
        assert np.array_equal(out[:2], raw[:2])
        assert np.array_equal(out[2:], converted(raw[2:]))
        assert s.get(toks, np.zeros((n, PB), np.uint8)).pages == 2
        # A lossy page takes about a quarter of a page's 4 KiB blocks.
        used = s._manager.tier(TierId("nvme")).used_bytes   # type: ignore[attr-defined]
        assert 6 * PB / 4 * 0.9 <= used <= 6 * (PB / 4 + 4096), used


def test_pages_demoted_from_dram_are_converted(tmp_path: Path) -> None:
    a, b = tokens(2, 2), tokens(3, 2)
    ra, rb = pages(2, 2), pages(3, 2)
    with Store.open(config(tmp_path / "s")) as s:
        s.put(a, ra)
        s.put(b, rb)                     # a's pages go down to the NVMe tier
        settle(s)
        assert s.lookup(a).cached_pages == 0 and s.lookup(b).cached_pages == 2
        out = np.zeros((2, PB), np.uint8)
        assert s.get(a, out, accept_lossy=BITS).lossy == 2
        assert np.array_equal(out, converted(ra))
        assert s.stats().lossy_converted == 2


def test_put_lossy_pages_that_come_down_are_left_as_they_are(tmp_path: Path) -> None:
    toks, raw = tokens(4, 2), pages(4, 2)
    with Store.open(config(tmp_path / "s")) as s:
        s.put_lossy(toks, raw, BITS)     # coded with eviction, in DRAM
        s.put(tokens(5, 2), pages(5, 2))    # pushes them down
        settle(s)
        assert s.stats().lossy_converted == 0
        out = np.zeros((2, PB), np.uint8)
        assert s.get(toks, out, accept_lossy=BITS).lossy == 2
        assert np.array_equal(out, converted(raw, evict=True))


def test_pinned_pages_and_pages_with_cached_children_wait(tmp_path: Path) -> None:
    n = 4
    toks, raw = tokens(6, n), pages(6, n)
    with Store.open(config(tmp_path / "s", policy="lru")) as s:
        with s._lock:                   # nothing converts before the pin
            s.put(toks, raw)            # 0, 1 in DRAM; 2, 3 in the NVMe tier
            assert s.pin(toks) == n
        assert s.wait_converted(10.0) == 2
        st = s.stats()
        assert (st.lossy_pending, st.lossy_waiting) == (0, 2)
        assert s.lookup(toks).cached_pages == n
        s.unpin(toks)
        settle(s)                       # 3 first (a leaf), then 2, its children gone
        assert s.lookup(toks).cached_pages == 2
        assert s.lookup(toks, accept_lossy=BITS).lossy == 2


def test_the_queue_survives_a_clean_close(tmp_path: Path) -> None:
    n = 4
    toks, raw = tokens(7, n), pages(7, n)
    path = tmp_path / "s"
    with Store.open(config(path)) as s:
        s.put(toks, raw)
        settle(s)
        assert s.lookup(toks).cached_pages == 2
    # The close wrote pages 0 and 1 back to the NVMe tier, as exact pages, and queued them.
    assert (path / PENDING_FILE).stat().st_size == 2 * 16
    with Store.open(config(path)) as s:
        assert not (path / PENDING_FILE).exists()
        settle(s)
        assert s.lookup(toks).cached_pages == 0
        out = np.zeros((n, PB), np.uint8)
        got = s.get(toks, out, accept_lossy=BITS)
        assert (got.pages, got.lossy) == (n, n)
        assert np.array_equal(out, converted(raw))
    with Store.open(config(path, dram_pages=4)) as s:   # and again, nothing left to do
        assert s.stats().lossy_pending == 0 and s.lookup(toks, accept_lossy=BITS).lossy == n


def test_a_calibration_weighs_the_conversion(tmp_path: Path) -> None:
    cal = Calibration("lossy-tier", (0.01, 10.0), (10.0, 0.01))
    cal.save(tmp_path / "cal.json")
    toks, raw = tokens(8, 3), pages(8, 3)
    with Store.open(config(tmp_path / "s", lossy_calibration=str(tmp_path / "cal.json"))) as s:
        s.put(toks, raw)
        settle(s)
        out = np.zeros((3, PB), np.uint8)
        assert s.get(toks, out, accept_lossy=BITS).lossy == 1
        assert np.array_equal(out[2], converted(raw[2:], cal)[0])
        assert not np.array_equal(out[2], converted(raw[2:])[0])


def test_a_store_without_a_lossy_tier_converts_nothing(tmp_path: Path) -> None:
    toks, raw = tokens(9, 4), pages(9, 4)
    with Store.open(config(tmp_path / "s", lossy_bits=0)) as s:
        s.put(toks, raw)
        assert s.wait_converted() == 0 and s.lookup(toks).cached_pages == 4
        assert s.stats().lossy_converted == 0


@pytest.mark.parametrize("kw, message", [
    ({"codec": "none"}, "needs codec"),
    ({"lossy_bits": 1.4}, r"below what pages of this layout code at keeping every token \(1\.482"),
    ({"lossy_bits": 0.5}, "at least 1 and under 16"),
    ({"lossy_bits": 16}, "at least 1 and under 16"),
    ({"lossy_bits": "4"}, "at least 1 and under 16"),
    ({"lossy_bits": 0, "lossy_calibration": "cal.json"}, "set nvme.lossy_bits too"),
])
def test_bad_tier_options_are_refused(tmp_path: Path, kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(tmp_path / "s", **kw)  # type: ignore[arg-type]


def test_stores_a_lossy_tier_cannot_serve_are_refused(tmp_path: Path) -> None:
    nvme = NvmeConfig(64 * PB, codec="lossless", lossy_bits=BITS)
    with pytest.raises(ConfigError, match="needs a tier above it"):
        StoreConfig(path=str(tmp_path / "s"), model_id="m", layout=LAYOUT, nvme=nvme)
    with pytest.raises(ConfigError, match="both set"):
        StoreConfig(path=str(tmp_path / "s"), model_id="m", layout=LAYOUT, dram=DramConfig(PB), nvme=nvme,
                    nvmeof=NvmeofConfig(device="/dev/null", codec="lossless", lossy_bits=BITS))
    latent = KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="bf16", tokens_per_page=64, kind="latent")
    with pytest.raises(ConfigError, match="K/V layouts"):
        StoreConfig(path=str(tmp_path / "s"), model_id="m", layout=latent, dram=DramConfig(PB), nvme=nvme)


def test_a_calibration_of_another_model_is_refused_at_open(tmp_path: Path) -> None:
    Calibration("other", (1.0,) * 3, (1.0,) * 3).save(tmp_path / "cal.json")
    with pytest.raises(ConfigError, match="calibrates 3 layers of 2 KV heads of 64 channels"):
        Store.open(config(tmp_path / "s", lossy_calibration=str(tmp_path / "cal.json")))
    Calibration("other", (1.0,) * 2, (1.0,) * 2, np.ones((2, 4, 64))).save(tmp_path / "cal.json")
    with pytest.raises(ConfigError, match="calibrates 2 layers of 4 KV heads"):
        Store.open(config(tmp_path / "s", lossy_calibration=str(tmp_path / "cal.json")))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a tierkv calibration file"):
        Store.open(config(tmp_path / "s2", lossy_calibration=str(tmp_path / "bad.json")))


def test_exposition_counts_conversions(tmp_path: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from tierkv.store.metrics import StoreCollector

    with Store.open(config(tmp_path / "s")) as s:
        s.put(tokens(10, 3), pages(10, 3))
        settle(s)
        registry = prometheus_client.CollectorRegistry()
        registry.register(StoreCollector(s))
        text = prometheus_client.generate_latest(registry).decode()
    assert "tierkv_lossy_converted_total 1.0" in text and "tierkv_lossy_pending 0.0" in text


N_PROMPTS, PROMPT_PAGES = 40, 3
CHILD = """
import sys
import numpy as np
from pathlib import Path
from tests.lossy.test_tier import N_PROMPTS, PROMPT_PAGES, config, pages, tokens
from tierkv.store.api import Store
rng = np.random.default_rng(int(sys.argv[2]))
store = Store.open(config(Path(sys.argv[1])))
print("ready", flush=True)
out = np.empty((PROMPT_PAGES, store.layout.page_bytes), np.uint8)
while True:
    i = int(rng.integers(N_PROMPTS))
    if rng.random() < 0.7:
        store.put(tokens(100 + i, PROMPT_PAGES), pages(100 + i, PROMPT_PAGES))
    else:
        store.get(tokens(100 + i, PROMPT_PAGES), out, accept_lossy=4.0)
"""


def test_a_writer_killed_while_converting_serves_no_wrong_bytes(tmp_path: Path) -> None:
    """SIGKILL at random moments of puts, demotions and conversions (5 times on one store):
    every page served afterwards is its exact bytes or exactly its conversion's."""
    import os
    import random
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    want = {i: (pages(100 + i, PROMPT_PAGES), converted(pages(100 + i, PROMPT_PAGES))) for i in range(N_PROMPTS)}
    path, served, lossy = tmp_path / "s", 0, 0
    for seed in range(5):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(seed)], cwd=root,
                                 env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", child.communicate(timeout=30)[1]
        time.sleep(random.Random(seed).uniform(0.3, 1.5))
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)
        with Store.open(config(path)) as s:
            for i, (exact, lossy_rows) in want.items():
                out = np.zeros((PROMPT_PAGES, PB), np.uint8)
                got = s.get(tokens(100 + i, PROMPT_PAGES), out, accept_lossy=BITS)
                k = got.pages - got.lossy
                assert np.array_equal(out[:k], exact[:k]), f"prompt {i}: wrong exact bytes"
                assert np.array_equal(out[k:got.pages], lossy_rows[k:got.pages]), f"prompt {i}: wrong lossy bytes"
                served, lossy = served + got.pages, lossy + got.lossy
    assert served and lossy, (served, lossy)   # the storm converted pages, and they came back


def test_a_page_queued_twice_is_converted_once(tmp_path: Path) -> None:
    toks, raw = tokens(11, 4), pages(11, 4)
    with Store.open(config(tmp_path / "s")) as s:
        with s._lock:                   # queued and not yet taken
            s.put(toks, raw)
            conv = s._converter
            assert conv is not None
            keys = s._keys(toks, "")[2 * 16:]
            conv._queue.extend(keys + keys)
        settle(s)
        s._manager.check()
        assert s.stats().lossy_converted == 2
        out = np.zeros((4, PB), np.uint8)
        assert s.get(toks, out, accept_lossy=BITS).lossy == 2
        assert np.array_equal(out[2:], converted(raw[2:]))


def test_pages_the_lossy_tier_demotes_are_kept_below_as_they_are(tmp_path: Path) -> None:
    """A lossy NVMe tier over an uncoded NVMe-oF one (a file here): what the NVMe tier
    demotes, lossy pages and exact ones not yet converted, is kept below as it is."""
    from tierkv.store.opening import LABEL_BYTES

    with open(tmp_path / "fabric.img", "wb") as f:
        f.truncate(LABEL_BYTES + 64 * PB)
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="lossy-tier", layout=LAYOUT, dram=DramConfig(2 * PB),
                      nvme=NvmeConfig(4 * PB, codec="lossless", lossy_bits=BITS),
                      nvmeof=NvmeofConfig(device=str(tmp_path / "fabric.img")))
    prompts = [(tokens(20 + i, 4), pages(20 + i, 4)) for i in range(6)]
    with Store.open(cfg) as s:
        for toks, raw in prompts:
            s.put(toks, raw)
        # A page whose children went below unconverted waits (converting it would strand them).
        left = s.wait_converted(30.0)
        st = s.stats()
        assert left == st.lossy_waiting and st.lossy_pending == 0 and st.lossy_converted > 0
        s._manager.check()
        for toks, raw in prompts:
            out = np.zeros((4, PB), np.uint8)
            got = s.get(toks, out, accept_lossy=BITS)
            k = got.pages - got.lossy
            assert np.array_equal(out[:k], raw[:k])
            assert np.array_equal(out[k:got.pages], converted(raw)[k:got.pages])
        assert s.stats().tiers["nvmeof"].used_slots > 0


def test_a_long_prompt_put_straight_into_the_tier_converts_in_one_pass(tmp_path: Path) -> None:
    """Its pages are queued children first, and a batch's children count as gone: one
    batch a BATCH of pages, none kept back (a parent-first queue converted one level a
    pass, each pass retrying every page kept back: quadratic)."""
    from tierkv.store import lossy_tier

    n = 120
    toks, raw = tokens(12, n), pages(12, n)
    batches = []
    real = lossy_tier.Converter._batch

    def counted(self: lossy_tier.Converter, keys: list[bytes], retry: bool) -> None:
        batches.append(len(keys))
        real(self, keys, retry)  # type: ignore[arg-type]

    lossy_tier.Converter._batch = counted  # type: ignore[method-assign,assignment]
    try:
        with Store.open(StoreConfig(path=str(tmp_path / "s"), model_id="lossy-tier", layout=LAYOUT,
                                    dram=DramConfig(2 * PB), nvme=NvmeConfig(2 * n * PB, codec="lossless",
                                                                              lossy_bits=BITS))) as s:
            s.put(toks, raw)
            settle(s)
            s._manager.check()
            assert s.stats().lossy_converted == n - 2
    finally:
        lossy_tier.Converter._batch = real  # type: ignore[method-assign]
    assert len(batches) == -(-(n - 2) // lossy_tier.BATCH), batches


def test_derived_pages_are_left_as_they_are(tmp_path: Path) -> None:
    from tierkv.splice.rope import Rope

    toks, raw = tokens(13, 6), pages(13, 6)
    with Store.open(config(tmp_path / "s", dram_pages=8, policy="lru")) as s:
        s.put(toks, raw)
        res = s.splice(toks, 20, 36, np.zeros(0, np.uint32), rope=Rope.from_theta(10000.0, 64))
        before = s.lookup(res.tokens, accept="derived").derived
        assert before > 0
        for i in range(4):                       # pushes everything down into the lossy tier
            s.put(tokens(50 + i, 4), pages(50 + i, 4))
        s.wait_converted(30.0)
        s._manager.check()
        got = s.get(res.tokens, np.zeros((5, PB), np.uint8), accept="derived")
        assert got.derived == before and set(got.tiers[-before:]) == {TierKind.NVME}   # in the lossy tier
        assert s.stats().lossy_converted > 0
        assert all(o is not None for o in s.origins(res.tokens)[-before:])


def test_a_page_that_cannot_be_coded_stays_exact_and_its_parents_wait(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    toks, raw = tokens(14, 5), pages(14, 5)
    raw[-1, :2] = (0xC0, 0x7F)                   # a bf16 NaN (0x7FC0) in the last page
    with Store.open(config(tmp_path / "s")) as s:
        s.put(toks, raw)                         # 2 in DRAM; 2, 3 wait on 4, which cannot be coded
        assert s.wait_converted(10.0) == 2
        st = s.stats()
        assert (st.lossy_converted, st.lossy_pending, st.lossy_waiting) == (0, 0, 2)
        out = np.zeros((5, PB), np.uint8)
        assert s.get(toks, out).pages == 5 and np.array_equal(out, raw)   # all still exact
    assert "cannot" in caplog.text or "finite" in caplog.text


def test_close_with_the_lock_held_and_bad_timeouts(tmp_path: Path) -> None:
    import threading

    from tierkv.errors import InputError

    s = Store.open(config(tmp_path / "s"))
    with pytest.raises(InputError, match="timeout_s is seconds"):
        s.wait_converted(float("nan"))
    with pytest.raises(InputError, match="timeout_s is seconds"):
        s.wait_converted(-1)
    assert s.wait_converted(np.float32(1.0)) == s.wait_converted(np.int64(1)) == s.wait_converted(1e10) == 0  # type: ignore[arg-type]

    def close_locked() -> None:
        with s._lock:
            s.close()

    t = threading.Thread(target=close_locked, daemon=True)
    t.start()
    t.join(30.0)
    assert not t.is_alive(), "close() with the store's lock held hung"



def test_pages_in_vllms_cpu_order_convert_as_the_same_pages_in_the_standard_order(tmp_path: Path) -> None:
    from tierkv.layout import from_standard_order, to_standard_order

    cpu = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=64, page_order="vllm_cpu")
    n = 4
    toks, std = tokens(15, n), pages(15, n)                 # standard-order pages
    raw = from_standard_order(std.view(np.uint16).reshape(n, *LAYOUT.page_shape), cpu).reshape(n, -1).view(np.uint8)
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="lossy-tier", layout=cpu, dram=DramConfig(2 * PB),
                      nvme=NvmeConfig(64 * PB, codec="lossless", lossy_bits=BITS))
    with Store.open(cfg) as s:
        s.put(toks, raw)
        settle(s)
        out = np.zeros((n, PB), np.uint8)
        got = s.get(toks, out, accept_lossy=BITS)
        assert (got.pages, got.lossy) == (n, 2)
        assert np.array_equal(out[:2], raw[:2])
        back = to_standard_order(out.view(np.uint16).reshape(n, *cpu.page_shape), cpu).reshape(n, -1).view(np.uint8)
        assert np.array_equal(back[2:], converted(std[2:]))   # the standard page's conversion, in its own order


def test_pages_kept_back_are_retried_under_a_steady_stream_of_new_pages(tmp_path: Path) -> None:
    """The retry runs on a clock of its own: new pages arriving more often than it is due
    (every 0.4 s here) do not put it off."""
    from tierkv.store import lossy_tier

    toks, raw = tokens(16, 3), pages(16, 3)
    with Store.open(config(tmp_path / "s", dram_pages=2)) as s:
        with s._lock:
            s.put(toks, raw)                   # 0, 1 in DRAM; 2 in the lossy tier, pinned
            s.pin(toks)
        assert s.wait_converted(10.0) == 1
        s.unpin(toks)
        deadline = time.monotonic() + lossy_tier.RETRY_S * 4
        i = 0
        while s.lookup(toks).cached_pages == 3:
            assert time.monotonic() < deadline, "the page kept back was never retried"
            s.put(tokens(100 + i, 1), pages(100 + i, 1))   # a stream of new pages, each pushing one down
            i += 1
            time.sleep(0.4)
        s.wait_converted(10.0)   # page 2 converted (and those the stream pushed down after it)
        look = s.lookup(toks, accept_lossy=BITS)
        assert look.cached_pages == 3 and look.lossy >= 1 and s.stats().lossy_waiting == 0


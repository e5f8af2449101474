"""``tierkv bench``: the benchmark suites of :mod:`tierkv.bench`, each printing ratios
against a baseline measured in the same run.

:func:`add_parser` registers the subcommand, :func:`run` is its handler: one JSON
object with ``--json``, else the suite's tables (:data:`TABLES`: one function per suite
from its JSON object to rich tables, every cell one number or word). Exit status 1 when
a suite's copies came back wrong (it measured nothing). ``scale`` (:mod:`tierkv.bench.scale`)
measures the page table's cost per page at ``--pages`` pages. The KV pages of ``codec`` and
``codec-store`` come from ``--kv``, else ``$TIERKV_KV_DIR``, else ``../shared/data/kv``
beside the source checkout (:func:`tierkv.bench.codec.load_kv`), never from the current
directory.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tierkv.cli.exits import EXIT_FAILED, EXIT_OK
from tierkv.errors import InputError
from tierkv.units import format_size

if TYPE_CHECKING:
    from rich.table import Table

#: Where the codec suites read KV pages when ``--kv`` is not given (``tierkv.bench.codec.KV_ENV``,
#: spelled out to keep imports light).
KV_ENV = "TIERKV_KV_DIR"


def add_parser(sub: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Add ``bench`` to ``tierkv``'s subparsers; its handler is :func:`run`."""
    bp = sub.add_parser("bench", help="run the tier and store benchmarks",
                        description="Run the benchmarks of tierkv.bench and print tables or JSON: "
                                    "'store' (default) measures the DRAM and NVMe tiers and the keys, "
                                    "'codec' the lossless KV codec against zipnn and zstd on real KV pages, "
                                    "'scale' the page table's memory and time per page at node scale against a dict.")
    bp.add_argument("suite", nargs="?", choices=("store", "codec", "codec-store", "net", "scale", "serve", "vllm",
                                                          "cluster", "dualpath", "splice", "lossy"),
                    default="store",
                    help="what to measure ('codec-store': an NVMe tier with codec none vs lossless; "
                         "'net': peer page fetches and incast over TCP, and RDMA where a device exists; "
                         "'scale': bytes, reopen, put, get and lookup per page of a store of --pages 4 KiB pages; "
                         "'serve': 1, 2 and 4 client processes of a tierkv serve daemon vs an in-process store; "
                         "'vllm': time to first token in a real vLLM engine over a 2K-token shared prefix: recompute, "
                         "vLLM's ExampleConnector, tierkv from DRAM and from NVMe, "
                         "engines interleaved (tools/install_vllm.sh; about 4 minutes); "
                         "'cluster': a local etcd and --nodes node daemons: pages published to the directory per s, "
                         "cross-node lookup p50/p99, etcd bytes per page, failover after a SIGKILL (about a minute); "
                         "'dualpath': storage, prefill and decode node daemons in network namespaces, each storage "
                         "NIC shaped by tc: load throughput of pe-only, shorter-queue and split, --runs rounds "
                         "(root; about a minute); "
                         "'splice': SmolLM2-135M: time to first token after a 256-token deletion, re-prefilled vs "
                         "spliced, first-layer key error, greedy agreement and NLL delta, and tokens reused on an "
                         "agent trace with edits (about a minute); "
                         "'lossy': SmolLM2-135M: NLL and top-1 agreement of a cache coded lossy at --budgets bits "
                         "an element, rate-distortion vs uniform allocation, and its bytes vs BF16 (a few minutes))")
    bp.add_argument("--kv", metavar="FILE.safetensors", help="codec, codec-store: KV tensors layerNN.k/.v "
                    f"[kv_heads, tokens, head_dim], or a folder of such files (default: ${KV_ENV}, else "
                    "../shared/data/kv beside the tierkv checkout)")
    bp.add_argument("--page-tokens", type=int, default=16, metavar="N", help="codec: tokens per page (default 16)")
    bp.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    bp.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    bp.add_argument("--pages", metavar="N", help="scale: pages of 4 KiB in the store, an integer >= 1 "
                    "(default 1,000,000; 4,096 with --quick); the DRAM tier holds 1%% of them")
    bp.add_argument("--nodes", type=int, default=None, metavar="N", help="cluster: node daemons (2-16; default 3)")
    bp.add_argument("--lease", type=int, default=None, metavar="S", help="cluster: the nodes' lease in seconds "
                    "(default 10; 3 with --quick)")
    bp.add_argument("--requests", type=int, default=None, metavar="N", help="dualpath: prompts loaded per policy "
                    "(default 12; 4 with --quick)")
    bp.add_argument("--storage-mbit", type=float, default=None, metavar="R", help="dualpath: each storage NIC's "
                    "rate in Mbit/s (default 400)")
    bp.add_argument("--dir", metavar="DIR", help="directory for the files of the store, codec-store and scale "
                    "suites (default: a temporary one; codec and net write none)")
    bp.add_argument("--device-mbps", metavar="R,R,...", help="codec-store: also measure with this process's I/O "
                    "on the disk under --dir capped at each rate in MB/s by the kernel's block throttle (root; a "
                    "cgroup blkio or io controller): where coding makes reads faster")
    bp.add_argument("--runs", type=int, default=None, metavar="N", help="repetitions per measurement")
    bp.add_argument("--budgets", metavar="B,B,...", help="lossy: average bits per element to code at "
                    "(default 2.5,3,4,8; 2.5,4 with --quick)")
    bp.add_argument("--text", metavar="FILE", help="lossy: the held text, a UTF-8 file of at least --context plus "
                    "--continuation tokens (default: docstrings of Python's standard library; the calibration "
                    "text stays those of other modules)")
    bp.set_defaults(handler=run)
    return bp


def run(args: argparse.Namespace) -> int:
    if args.runs is not None and args.runs < 1:
        raise InputError(f"--runs must be >= 1, got {args.runs}")
    if args.page_tokens < 1:
        raise InputError(f"--page-tokens must be >= 1, got {args.page_tokens}")
    if args.pages is not None and args.suite not in ("scale", "cluster", "dualpath"):
        raise InputError(f"--pages is for the scale, cluster and dualpath suites, not {args.suite}")
    if (args.requests is not None or args.storage_mbit is not None) and args.suite != "dualpath":
        raise InputError(f"--requests and --storage-mbit are for the dualpath suite, not {args.suite}")
    if (args.budgets is not None or args.text is not None) and args.suite != "lossy":
        raise InputError(f"--budgets and --text are for the lossy suite, not {args.suite}")
    if args.device_mbps is not None and args.suite != "codec-store":
        raise InputError(f"--device-mbps is for the codec-store suite, not {args.suite}")
    if (args.nodes is not None or args.lease is not None) and args.suite != "cluster":
        raise InputError(f"--nodes and --lease are for the cluster suite, not {args.suite}")
    if args.suite == "scale":
        from tierkv.bench.scale import DEFAULT_PAGES, QUICK_PAGES, check_pages, run_scale

        if args.runs is not None:
            raise InputError("--runs is not for the scale suite: it times each page once "
                             "(gets repeat to about 65,536 pages)")
        default = QUICK_PAGES if args.quick else DEFAULT_PAGES
        result = run_scale(check_pages(args.pages) if args.pages is not None else default, where=args.dir)
    elif args.suite == "cluster":
        result = _cluster(args)
    elif args.suite == "dualpath":
        result = _dualpath(args)
    elif args.suite == "splice":
        result = _splice(args)
    elif args.suite == "lossy":
        result = _lossy(args)
    elif args.suite == "vllm":
        result = _vllm(args)
    elif args.suite == "serve":
        from tierkv.bench.serve import run_serve_bench

        if args.runs is not None:
            raise InputError("--runs is not for the serve suite: each client runs its rounds once")
        result = run_serve_bench(quick=args.quick, where=args.dir)
    elif args.suite == "codec":
        from tierkv.bench.codec import run_codec_bench

        result = run_codec_bench(kv_source(args.kv), args.page_tokens, args.runs or (2 if args.quick else 3))
    elif args.suite == "net":
        from tierkv.bench.net import net_report

        result = net_report(quick=args.quick)
    elif args.suite == "codec-store":
        from tierkv.bench.codec_store import run_codec_store_bench

        result = run_codec_store_bench(kv_source(args.kv), args.page_tokens, args.runs or (1 if args.quick else 3),
                                       where=args.dir, copies=2 if args.quick else 8,
                                       device_mbps=_rates(args.device_mbps))
    else:
        from tierkv.bench.headline import run

        result = run(args)
    # A benchmark whose copies came back wrong measured nothing: say so in the exit status.
    status = (EXIT_FAILED if result.get("mismatches") or result.get("failover_wrong") or result.get("verified") is False
              else EXIT_OK)
    if args.json:
        print(json.dumps(result))
        return status
    from rich.console import Console

    console = Console()
    for table in TABLES[args.suite](result):
        console.print(table)
    return status


def _cluster(args: argparse.Namespace) -> dict[str, object]:
    import sys

    from tierkv.bench.cluster import run_cluster_bench
    from tierkv.bench.scale import check_pages

    nodes = 3 if args.nodes is None else args.nodes
    if not 2 <= nodes <= 16:
        raise InputError(f"--nodes must be 2 to 16, got {nodes}")
    lease = args.lease if args.lease is not None else (3 if args.quick else 10)
    if not 2 <= lease <= 3600:
        raise InputError(f"--lease must be 2 to 3600 seconds, got {lease}")
    pages = check_pages(args.pages) if args.pages is not None else (2048 if args.quick else 32768)
    if args.runs is not None:
        raise InputError("--runs is not for the cluster suite: it measures --pages pages and 1,000 lookups once")
    return run_cluster_bench(nodes=nodes, pages=pages, lookups=200 if args.quick else 1000, lease_ttl_s=lease,
                             where=args.dir, step=None if args.json else
                             lambda what: print(f"cluster: {what}", file=sys.stderr, flush=True))


def _dualpath(args: argparse.Namespace) -> dict[str, object]:
    import sys

    from tierkv.bench.dualpath import run_dualpath_bench
    from tierkv.bench.scale import check_pages

    rounds = args.runs if args.runs is not None else (1 if args.quick else 3)
    requests = args.requests if args.requests is not None else (4 if args.quick else 12)
    if not 1 <= requests <= 10_000:
        raise InputError(f"--requests must be 1 to 10,000, got {requests}")
    pages = check_pages(args.pages) if args.pages is not None else (32 if args.quick else 128)
    if pages > 4096:
        raise InputError(f"--pages is pages per prompt here, at most 4,096, got {pages}")
    mbit = 400.0 if args.storage_mbit is None else args.storage_mbit
    if not 1 <= mbit <= 100_000:
        raise InputError(f"--storage-mbit must be 1 to 100,000, got {mbit:g}")
    return run_dualpath_bench(requests=requests, pages=pages, storage_mbit=mbit, rounds=rounds, where=args.dir,
                              step=None if args.json else
                              lambda what: print(f"dualpath: {what}", file=sys.stderr, flush=True))


def _splice(args: argparse.Namespace) -> dict[str, object]:
    import sys

    from tierkv.bench.splice import run_splice_bench
    from tierkv.integrations import smollm2

    missing = smollm2.missing_requirements()
    if missing:
        raise InputError(f"the splice benchmark runs SmolLM2-135M: it needs {', '.join(missing)} "
                         f"({smollm2.INSTALL_HINT})")
    runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    kw = dict(context=512, delete=128, generate=8, continuation=16, sessions=2, turns=5) if args.quick else {}
    return run_splice_bench(runs=runs, where=args.dir, **kw,  # type: ignore[arg-type]
                            step=None if args.json else
                            lambda what: print(f"splice: {what}", file=sys.stderr, flush=True))


def _lossy(args: argparse.Namespace) -> dict[str, object]:
    import sys

    from tierkv.bench.lossy import DEFAULT_BUDGETS, run_lossy_bench
    from tierkv.integrations import smollm2

    missing = smollm2.missing_requirements()
    if missing:
        raise InputError(f"the lossy benchmark runs SmolLM2-135M: it needs {', '.join(missing)} "
                         f"({smollm2.INSTALL_HINT})")
    if args.runs is not None:
        raise InputError("--runs is not for the lossy suite: its figures are deterministic")
    budgets: tuple[float, ...] = (2.5, 4.0) if args.quick else DEFAULT_BUDGETS
    if args.budgets is not None:
        try:
            budgets = tuple(float(b) for b in args.budgets.split(","))
        except ValueError:
            raise InputError(f"--budgets must be numbers separated by commas, got {args.budgets!r}") from None
        if not budgets or not all(1.0 <= b <= 16.0 for b in budgets):
            raise InputError(f"--budgets must each be 1 to 16 bits per element, got {args.budgets!r}")
    kw: dict[str, object] = dict(context=512, continuation=32, generate=16) if args.quick else {}
    if args.text is not None:
        from pathlib import Path

        try:
            kw["held_text"] = Path(args.text).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--text: cannot read {args.text}: {exc}") from None
        kw["text_name"] = args.text
    return run_lossy_bench(budgets, **kw,  # type: ignore[arg-type]
                           say=(lambda _m: None) if args.json else
                           lambda what: print(f"lossy: {what}", file=sys.stderr, flush=True))


def _vllm(args: argparse.Namespace) -> dict[str, object]:
    import shutil
    import tempfile
    from pathlib import Path

    from tierkv.integrations.vllm.bench import run_vllm_bench, steps
    from tierkv.integrations.vllm.session import find_vllm
    from tierkv.progress import task_progress

    env = find_vllm()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tierkv-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        requests = args.runs or (3 if args.quick else 10)
        with task_progress("vLLM engines, then rounds", steps(requests), enabled=not args.json) as step:
            return run_vllm_bench(env, work, requests=requests, recompute_requests=2 if args.quick else 3,
                                  prefix_tokens=1024 if args.quick else 2048, step=step)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def kv_source(kv: str | None) -> str | None:
    """``--kv``, else ``$TIERKV_KV_DIR`` (which must then exist), else None: the library's default."""
    if kv is not None:
        return kv
    env = os.environ.get(KV_ENV)
    if not env:
        return None
    if not os.path.exists(env):
        raise InputError(f"{KV_ENV}={env} does not exist; expected a .safetensors file of KV tensors or a "
                         "folder of them (or pass --kv)")
    return env


# --------------------------------------------------------------------------------------
# Tables: one function per suite, from its JSON object to rich tables.


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:#.3g}"
    return str(value)


def _table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]], caption: str | None = None,
           labels: int = 1) -> Table:
    """A table whose first ``labels`` columns are names (left-aligned), the rest figures."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < labels else "right")
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    return table


def _map(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _maps(value: object) -> list[Mapping[str, object]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _size(value: object) -> str:
    return format_size(value) if isinstance(value, (int, float)) else "-"


#: The store suite's headline ratios: label, key, what it is measured against.
_HEADLINE = (("DRAM tier put", "dram_put_vs_memcpy", "memcpy of the same bytes"),
             ("DRAM tier get", "dram_get_vs_memcpy", "memcpy of the same bytes"),
             ("NVMe tier write", "nvme_write_vs_fio", "fio: same file, block size, queue depth"),
             ("NVMe tier read", "nvme_read_vs_fio", "fio: same file, block size, queue depth"),
             ("keys + lookup of a prompt", "keys_vs_sha256", "chained sha256 + dict"))


def store_tables(r: Mapping[str, object]) -> Iterator[Table]:
    shapes = _maps(r.get("shapes"))
    first = shapes[0] if shapes else {}
    yield _table(f"headline ratios, higher is better (pages of {_size(first.get('page_bytes'))}; "
                 f"{r.get('runs')} runs)", ("measurement", "ratio", "against, in the same run"),
                 [(label, r.get(key), base) for label, key, base in _HEADLINE])
    dram = [(_size(s.get("page_bytes")), s.get("pages"), *(_map(s.get("dram")).get(k) for k in
             ("dram_put_gbps", "dram_get_gbps", "tier_scattered_put_gbps", "tier_scattered_get_gbps",
              "memcpy_gbps"))) for s in shapes]
    yield _table("DRAM tier vs memcpy (GB/s)", ("page", "pages", "put", "get", "copy in, scattered slots",
                                                "copy out, scattered slots", "memcpy"), dram,
                 caption="put and get: through the store; scattered slots: the copy loop of the tier alone")
    for s in shapes:
        n = _map(s.get("nvme"))
        depth = _map(n.get("fio_queue_depth"))
        yield _table(f"NVMe tier vs fio: {_size(s.get('page_bytes'))} pages x {_cell(s.get('pages'))} (GB/s)",
                     ("", "tier", "fio", "tier / fio"),
                     [(label, n.get(f"nvme_{k}_gbps"), n.get(f"fio_{k.split('_')[0]}_gbps"), n.get(f"nvme_{k}_vs_fio"))
                      for label, k in (("write", "write"), ("read", "read"), ("write, unaligned buffers",
                                       "write_unaligned"), ("read, unaligned buffers", "read_unaligned"),
                                       ("write, buffers on huge pages", "write_huge"),
                                       ("read, buffers on huge pages", "read_huge"),
                                       ("write from DRAM slots", "write_pool"),
                                       ("read into DRAM slots", "read_pool"))],
                     caption=f"{_cell(n.get('io_threads'))} I/O threads; fio queue depth {_cell(depth.get('write'))} "
                             f"(write), {_cell(depth.get('read'))} (read); verified: {_cell(n.get('verified'))}")
    k = _map(r.get("keys"))
    yield _table(f"keys and lookup of a {_cell(k.get('prompt_tokens'))}-token prompt (ms)",
                 ("", "keys", "lookup", "total"),
                 [("Store.lookup", None, None, k.get("store_lookup_ms")),
                  ("tierkv key chain + key set", k.get("tierkv_keys_ms"), k.get("tierkv_lookup_ms"), k.get("tierkv_ms")),
                  ("chained sha256 + dict", k.get("sha256_keys_ms"), k.get("sha256_lookup_ms"), k.get("sha256_ms"))],
                 caption=f"native key chain: {_cell(k.get('native'))}")


#: The codec suite's codecs: column name, key prefix.
_CODECS = (("tierkv", ""), ("zipnn", "zipnn_"), ("zipnn bulk", "zipnn_bulk_"), ("zstd", "zstd_"))


def codec_tables(r: Mapping[str, object]) -> Iterator[Table]:
    dtypes = {name: _map(d) for name, d in _map(r.get("dtypes")).items()}
    versions = ", ".join(f"{k} {_cell(v)}" for k, v in _map(r.get("versions")).items())
    caption = (f"{r.get('kv')}: {r.get('layers')} layers, {r.get('page_tokens')}-token pages; "
               f"best of {r.get('runs')} runs, {r.get('clock')}; native codec: {_cell(r.get('native'))}; {versions}")
    yield _table("compressed / original, lower is better", ("dtype", "pages", "page", *(c for c, _ in _CODECS)),
                 [(n, d.get("pages"), _size(d.get("page_bytes")), *(d.get(f"{p}ratio") for _, p in _CODECS))
                  for n, d in dtypes.items()])
    threads = next((d.get("threads") for d in dtypes.values() if d.get("threads")), None)
    parallel = (f"tierkv, {threads} threads",) if threads else ()
    for what in ("compress", "decompress"):
        rows = [(n, *(d.get(f"{p}{what}_gbps") for _, p in _CODECS),
                 *((d.get(f"{what}_gbps_threads"),) if threads else ())) for n, d in dtypes.items()]
        yield _table(f"{what} GB/s of original bytes, one thread", ("dtype", *(c for c, _ in _CODECS), *parallel),
                     rows, caption=caption if what == "decompress" else None)
    h2h = [(n, d.get("h2h_decompress_gbps"), d.get("h2h_zipnn_bulk_decompress_gbps"),
            d.get("h2h_decompress_vs_zipnn_bulk")) for n, d in dtypes.items() if d.get("h2h_decompress_gbps")]
    if h2h:
        yield _table("decompress GB/s head to head, the two alternating in the same minutes",
                     ("dtype", "tierkv", "zipnn bulk", "tierkv / zipnn bulk"), h2h)


def _rates(text: str | None) -> list[float]:
    """``--device-mbps R,R,...`` as positive floats."""
    if text is None:
        return []
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"--device-mbps must be comma-separated MB/s, e.g. 300,600; got {text!r}") from None
    from tierkv.bench.codec_store import MAX_DEVICE_MBPS

    if not rates or not all(1 <= r <= MAX_DEVICE_MBPS for r in rates):   # NaN and inf fail too
        raise InputError(f"--device-mbps rates must be between 1 and {MAX_DEVICE_MBPS:,} MB/s, got {text!r}")
    return rates


def codec_store_tables(r: Mapping[str, object]) -> Iterator[Table]:
    cap = r.get("capacity_pages")
    rows: list[Sequence[object]] = [(m, *(_map(r.get(m)).get(k) for k in ("put_gbps", "get_gbps",
                                    "raw_page_equivalents_used", "pages_before_first_eviction")))
                                    for m in ("none", "lossless")]
    rows.append(("lossless / none", r.get("put_ratio"), r.get("get_ratio"), r.get("space_ratio"),
                 r.get("capacity_gain")))
    yield _table(f"an NVMe tier with codec none vs lossless: {r.get('pages')} pages of {_size(r.get('page_bytes'))}",
                 ("codec", "put GB/s", "get GB/s", "space used", f"pages in {cap} slots"), rows,
                 caption=f"space used: slots per page (1 = uncoded); pages in {cap} slots: held by a tier sized "
                         f"for {cap} raw pages before its first eviction; every page read back checked; "
                         f"{r.get('kv_file')}; auto: {_map(r.get('auto')).get('reason')}")
    throttled = _maps(r.get("throttled"))
    if throttled:
        yield _table("the same disk capped by the kernel's block throttle",
                     ("disk MB/s", "pages", "none put", "none get", "lossless put", "lossless get", "get lossless/none",
                      "auto codes"),
                     [(t.get("device_mbps"), t.get("pages"), _map(t.get("none")).get("put_gbps"),
                       _map(t.get("none")).get("get_gbps"), _map(t.get("lossless")).get("put_gbps"),
                       _map(t.get("lossless")).get("get_gbps"), t.get("get_ratio"), _map(t.get("auto")).get("coding"))
                      for t in throttled],
                     caption="GB/s of raw page bytes; auto: what codec = \"auto\" chose after measuring the capped disk")


def net_tables(r: Mapping[str, object]) -> Iterator[Table]:
    columns = (("p50 µs", "p50_us"), ("p99 µs", "p99_us"), ("pages/s", "pages_per_s"), ("GB/s", "gb_per_s"),
               ("misses", "misses"), ("NAKs", "naks"), ("mismatches", "mismatches"))
    incast = ", ".join(f"{k.replace('_', ' ')} {_cell(v)}" for k, v in _map(r.get("incast")).items())
    yield _table("peer page fetches", ("link", "case", *(c for c, _ in columns)),
                 [(x.get("kind"), x.get("case"), *(x.get(k) for _, k in columns)) for x in _maps(r.get("results"))],
                 caption=f"incast: {incast}", labels=2)
    ratios = [(k.replace("_", " "), v) for k, v in r.items() if k not in ("results", "incast") and not
              isinstance(v, (Mapping, list))]
    yield _table("in the same run", ("measurement", "value"), ratios)


#: The scale suite's figures: label, key, issue 20's target for the store.
_SCALE = (("bytes per page entry", "bytes_per_page_entry", "<= 100"),
          ("reopen s per million pages", "reopen_s_per_million_pages", "<= 2"),
          ("put µs per page (into DRAM)", "put_us_per_page", "<= 2"),
          ("get µs per page (DRAM hits)", "get_us_per_page", "<= 2"),
          ("lookup µs per page", "lookup_us_per_page", "-"))


def scale_tables(r: Mapping[str, object]) -> Iterator[Table]:
    ref, ratio, timed = _map(r.get("dict")), _map(r.get("store_vs_dict")), _map(r.get("timed"))
    yield _table(f"the page table at {_cell(r.get('pages'))} pages of {_size(r.get('page_bytes'))}: store vs dict, "
                 "lower is better", ("figure", "tierkv store", "dict", "store / dict", "target"),
                 [(label, r.get(key), ref.get(key), ratio.get(key), target) for label, key, target in _SCALE])
    yield _table("in the same run", ("figure", "value"), [
        ("policy", r.get("policy")), ("DRAM tier pages", r.get("dram_pages")), ("pages per call", r.get("batch_pages")),
        ("reopen s", r.get("reopen_s")), ("reopen bytes per page entry", r.get("reopen_bytes_per_page_entry")),
        ("anonymous bytes per page entry (no file-backed pages)", r.get("anon_bytes_per_page_entry")),
        ("what the store says it holds, bytes per page: page table, policies, index file",
         f"{_cell(r.get('table_bytes_per_page'))}, {_cell(r.get('policy_bytes_per_page'))}, "
         f"{_cell(r.get('index_file_bytes_per_page'))}"),
        ("bulk put µs per page (with demotions to NVMe)", r.get("load_us_per_page")), ("close s", r.get("close_s")),
        ("copy µs per page (np.copyto of a get's bytes)", r.get("copy_us_per_page")),
        ("key chain µs per page", ref.get("key_chain_us_per_page")),
        ("pages put, DRAM puts / gets timed", f"{_cell(r.get('pages_stored'))}, {_cell(r.get('put_pages_timed'))} / "
                                              f"{_cell(r.get('get_pages_timed'))}"),
        ("verified (every page stored and found, timed puts and gets in DRAM, bytes equal)", r.get("verified"))])
    yield _table("what is measured", ("figure", "what"), timed.items(), labels=2)


def serve_tables(r: Mapping[str, object]) -> Iterator[Table]:
    yield _table("node service vs in-process store, higher is better", ("measurement", "value", "target"), [
        ("put vs in-process (1 client, first page size)", r.get("put_vs_inprocess"), ">= 0.9"),
        ("get vs in-process (1 client, first page size)", r.get("get_vs_inprocess"), ">= 0.9"),
        ("lookup p50 µs (131,072 tokens)", r.get("lookup_p50_us"), "-"),
        ("lookup p99 µs (131,072 tokens)", r.get("lookup_p99_us"), "<= 200"),
        ("in-process lookup p50 / p99 µs", f"{_cell(r.get('inprocess_lookup_p50_us'))} / "
                                           f"{_cell(r.get('inprocess_lookup_p99_us'))}", "-"),
        ("memcpy on 2 threads / 1 (the most 2 clients can gain here)", r.get("memcpy_2_threads_vs_1"), "-"),
        ("verified", r.get("verified"), "yes")])
    for s in _maps(r.get("shapes")):
        base = _map(s.get("inprocess"))
        rows: list[Sequence[object]] = [("in-process store", 1, base.get("put_gbps"), base.get("get_gbps"), 1.0, 1.0)]
        for c in _maps(s.get("clients")):
            rows.append(("daemon, page_buffer", c.get("clients"), c.get("put_gbps"), c.get("get_gbps"),
                         _ratio(c.get("put_gbps"), base.get("put_gbps")), _ratio(c.get("get_gbps"), base.get("get_gbps"))))
        sc = _map(s.get("scratch_1_client"))
        rows.append(("daemon, own arrays", 1, sc.get("put_gbps"), sc.get("get_gbps"), s.get("put_vs_inprocess_scratch"),
                     s.get("get_vs_inprocess_scratch")))
        yield _table(f"{_size(s.get('page_bytes'))} pages, {_cell(s.get('pages_per_batch'))} per batch, "
                     f"{_cell(s.get('rounds'))} rounds per client (aggregate GB/s)",
                     ("backend", "clients", "put", "get", "put / in-process", "get / in-process"), rows)


def cluster_tables(r: Mapping[str, object]) -> Iterator[Table]:
    yield _table(f"cluster of {_cell(r.get('nodes'))} nodes on loopback, {_cell(r.get('pages'))} pages of "
                 f"{_size(r.get('page_bytes'))}, lease {_cell(r.get('lease_ttl_s'))} s",
                 ("measurement", "value", "baseline", "target"), [
        ("pages published per s (put until in the directory)", r.get("publish_pages_per_s"),
         f"puts alone: {_cell(r.get('put_pages_per_s'))}", ">= 5,000"),
        ("lookup p50 ms, 64 pages another node holds", r.get("lookup_p50_ms"),
         f"own pages: {_cell(r.get('local_lookup_p50_ms'))}", "-"),
        ("lookup p99 ms, 64 pages another node holds", r.get("lookup_p99_ms"),
         f"own pages: {_cell(r.get('local_lookup_p99_ms'))}", "<= 5"),
        ("best_nodes p50 / p99 ms", f"{_cell(r.get('best_nodes_p50_ms'))} / {_cell(r.get('best_nodes_p99_ms'))}",
         "-", "-"),
        ("etcd keys per page", r.get("etcd_keys_per_page"), "-", "-"),
        ("etcd bytes per page", r.get("etcd_bytes_per_page"), "-", "-"),
        ("etcd bytes at 10^8 pages", _size(r.get("etcd_bytes_at_1e8_pages")), "-", "< 8 GiB"),
        ("follower bytes per anchor (each node's table)", r.get("follower_bytes_per_anchor"), "-", "-"),
        ("follower bytes at 10^8 pages", _size(r.get("follower_bytes_at_1e8_pages")), "-", "-"),
        ("failover s (SIGKILL until no node asks it)", r.get("failover_s"), f"the lease: {_cell(r.get('lease_ttl_s'))}",
         "<= 12 with a 10 s lease"),
        ("slowest lookup during failover, ms", r.get("failover_lookup_max_ms"), "-", "-"),
        ("wrong answers (lookups, hints, failover)", f"{_cell(r.get('mismatches'))}, "
                                                      f"{_cell(r.get('failover_wrong'))}", "-", "0, 0")])


def dualpath_tables(r: Mapping[str, object]) -> Iterator[Table]:
    policies = _map(r.get("policies"))
    rows = []
    for name in ("pe-only", "shorter-queue", "split"):
        p = _map(policies.get(name))
        rate = p.get("load_bytes_s")
        rows.append((name, p.get("seconds"), f"{rate / 1e6:.1f}" if isinstance(rate, (int, float)) else "-",
                     p.get("throughput_vs_pe_only"), p.get("prefill_bytes_fraction"), p.get("pages_fallback"),
                     p.get("pages_missed")))
    yield _table(f"DualPath in network namespaces: {_cell(r.get('rounds'))} rounds of {_cell(r.get('requests'))} "
                 f"prompts of {_cell(r.get('pages_per_request'))} pages of {_size(r.get('page_bytes'))} per policy, "
                 "storage NICs "
                 f"{_cell(r.get('storage_mbit'))} Mbit/s, compute link unshaped",
                 ("policy", "seconds", "MB/s", "vs pe-only", "prefill share of bytes", "fallback pages", "missed"),
                 rows)
    yield _table("targets", ("measurement", "value", "target"), [
        ("split / pe-only", r.get("split_vs_pe_only"), ">= 1.6"),
        ("split: prefill share of bytes", r.get("split_prefill_bytes_fraction"), "0.4-0.6"),
        ("pe-only / one storage NIC's rate", r.get("pe_only_vs_one_nic"), "-"),
        ("prompts with wrong bytes", r.get("mismatches"), "0")])


def splice_tables(r: Mapping[str, object]) -> Iterator[Table]:
    yield _table(f"SmolLM2-135M, a {_cell(r.get('context'))}-token context with {_cell(r.get('delete'))} tokens "
                 "deleted mid-context (fp32, CPU)", ("measurement", "value", "target"), [
        ("time to first token, re-prefill s", r.get("ttft_s_reprefill"), "-"),
        ("time to first token, splice s", r.get("ttft_s_splice"), "-"),
        ("re-prefill / splice", r.get("ttft_reprefill_vs_splice"), ">= 3"),
        ("tokens prefilled: re-prefill / splice", f"{_cell(r.get('prefilled_tokens_reprefill'))} / "
                                                  f"{_cell(r.get('prefilled_tokens_splice'))}", "-"),
        ("first layer's key max abs error", r.get("layer0_key_max_abs_err"), "<= 1e-4"),
        ("greedy agreement (positions; leading run)", f"{_cell(r.get('greedy_agreement'))}; "
                                                      f"{_cell(r.get('greedy_leading_agreement'))}", "reported"),
        ("NLL delta, nats per token (splice - re-prefill)", r.get("nll_delta"), "reported")])
    yield _table(f"agent trace: {_cell(r.get('trace_sessions'))} sessions, {_cell(r.get('trace_edits'))} edits",
                 ("measurement", "value", "target"), [
        ("tokens reused, exact pages", r.get("tokens_reused_exact"), "-"),
        ("tokens reused, exact and derived pages", r.get("tokens_reused_splice"), "-"),
        ("gain, points of the cached context", r.get("reuse_gain_points"), ">= 30")])


def lossy_tables(r: Mapping[str, object]) -> Iterator[Table]:
    budgets = r.get("budgets")
    rows = []
    if isinstance(budgets, list):
        for i, b in enumerate(budgets):
            def at(name: str) -> object:
                v = r.get(name)
                return v[i] if isinstance(v, list) and i < len(v) else None
            rows.append((b, at("delta_nll"), at("no_evict_delta_nll"), at("tier_delta_nll"), at("uniform_delta_nll"),
                         at("agreement"), at("tier_agreement"), at("uniform_agreement"), at("bytes_ratio"),
                         at("tier_bytes_ratio"), at("kept_fraction")))
    yield _table(f"SmolLM2-135M, {_cell(r.get('context_tokens'))}-token prompt of {_cell(r.get('text'))} in "
                 f"{_cell(r.get('page_tokens'))}-token "
                 f"pages, lossless NLL {_cell(r.get('nll_lossless'))} nats/token (targets: delta NLL <= 0.05 at 4 bits; "
                 "rate-distortion below uniform at 2.5)",
                 ("bits/element", "delta NLL", "no eviction", "lossy tier", "uniform", "top-1 agreement",
                  "lossy tier", "uniform", "bytes vs BF16", "lossy tier's", "tokens kept"), rows)


def vllm_tables(r: Mapping[str, object]) -> Iterator[Table]:
    modes = _map(r.get("modes"))

    def spread(mode: Mapping[str, object]) -> str:
        each = mode.get("vs_example_connector_rounds")
        if not isinstance(each, list) or not each:
            return "-"
        return f"{min(each):.2f}-{max(each):.2f}"

    def count(mode: Mapping[str, object]) -> int:
        each = mode.get("ttft_s_each")
        return len(each) if isinstance(each, list) else 0

    rows = [(name, _map(modes.get(name)).get("ttft_s"), count(_map(modes.get(name))),
             _map(modes.get(name)).get("tokens_loaded"), _map(modes.get(name)).get("prompt_tokens"),
             spread(_map(modes.get(name))))
            for name in ("recompute", "example_connector", "tierkv_dram", "tierkv_nvme", "tierkv_nvme_page_cache")]
    yield _table(f"vLLM time to first token, {_cell(r.get('prefix_tokens'))}-token shared prefix, engines "
                 "interleaved (median over the requests)",
                 ("mode", "TTFT s", "requests", "tokens loaded", "prompt", "per round / ExampleConnector"), rows)
    yield _table("ratios, lower is better", ("measurement", "value", "target"), [
        ("tierkv DRAM / recompute", r.get("ttft_dram_vs_recompute"), "<= 0.1"),
        ("tierkv NVMe / recompute", r.get("ttft_nvme_vs_recompute"), "<= 0.2"),
        ("tierkv DRAM / ExampleConnector", r.get("ttft_dram_vs_example_connector"), "<= 1.0"),
        ("tierkv NVMe / ExampleConnector", r.get("ttft_nvme_vs_example_connector"), "<= 1.0"),
        ("tierkv NVMe through the page cache / ExampleConnector", r.get("ttft_nvme_page_cache_vs_example_connector"), "-")])


def _ratio(a: object, b: object) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


#: Each suite's tables, by suite name.
TABLES: dict[str, Callable[[Mapping[str, object]], Iterable[Table]]] = {
    "store": store_tables, "codec": codec_tables, "codec-store": codec_store_tables, "net": net_tables,
    "scale": scale_tables, "serve": serve_tables, "vllm": vllm_tables, "cluster": cluster_tables,
    "dualpath": dualpath_tables, "splice": splice_tables, "lossy": lossy_tables}

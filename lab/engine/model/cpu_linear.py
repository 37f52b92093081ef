"""`x @ w^T` on the CPU by whichever of two layouts is faster on this host, measured, not assumed.

For products of few rows (decode steps) the BLAS under torch may run the "NN" product
`(w @ x^T)^T` of the [out, in] weights much faster or much slower than `F.linear`'s "NT" product,
depending on the CPU, its ISA and the BLAS build: the same torch wheel gives opposite answers on
an AMD EPYC and on an Intel Xeon with AVX-512. So at load, for every weight shape of the model and
every bucket of row counts up to `NARROW_MAX_ROWS`, both are timed on this host (interleaved
repeats after a warm-up, over several layers' weights in the model's order so that they come from
memory as in a decode step) and the faster is used from then on. The choices are kept in a small
JSON file under the engine's cache root, one per host key (CPU model, ISA flags, torch version,
torch threads), so later boots on the same host reuse them without measuring.

Each layout's figure is its fastest repeat, not the median: on a host whose cores other processes
share, a two-thread product waits whenever the OS has lent one of its threads' cores away, which
adds whole scheduler ticks to products far shorter than one. Waiting only ever adds time, so the
fastest repeat is the product's own cost. When the host is so busy that the measurement's threads
spent much of it waiting for a core, no repeat is clean: the figures then serve that boot only
and are not written, and a later boot measures again.

Both layouts compute the same sums of the same products; only the BLAS's blocking differs, so
outputs agree with `F.linear` to float rounding.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from lab.engine.cache_dir import cache_root

log = logging.getLogger(__name__)

NARROW_MAX_ROWS = 64  # past this, F.linear untimed: the narrow product only ever helped few-row products
ROW_BUCKETS = tuple(1 << i for i in range(NARROW_MAX_ROWS.bit_length()))  # 1, 2, 4, ..., 64: timed at these
FORMAT = 1  # bump when what a choices file means changes; older files are then re-measured
REPEATS = 3
MAX_WAITING_SHARE = 0.1  # a measurement whose threads waited for a core longer is not written (_waiting_share)
PASS_BYTES = 64 << 20  # layer weights per timed pass: beyond a desktop or small server's last-level cache
# ISA features that decide which BLAS kernels run; anything else in /proc/cpuinfo does not.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")

_builds: list[Path] = []
_writes: list[Path] = []
# Choices this process measured but did not write, by choices file: its later loads use the same
# layouts rather than measuring again, so two engines in one process compute the same sums.
_unwritten: dict[Path, dict[str, list[dict]]] = {}


def choice_builds() -> list[Path]:
    """The choices files this process had to measure for, one entry per load that measured (and
    wrote the file, or could not: a read-only cache root, a host too busy to trust the figures). A
    load whose every choice came from the file adds nothing, so comparing the length before and
    after a load says whether it built."""
    return list(_builds)


def choice_writes() -> list[Path]:
    """The choices files this process measured for and wrote, one entry per load that did: what a
    later boot on this host reuses (a measurement too busy to be written is reused by none)."""
    return list(_writes)


def narrow_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w^T` computed as `(w @ x^T)^T`."""
    rows = x.shape[0]
    # One row is padded to two with a real copy: MKL's one-column path, and a stride-0 view, are slow.
    xt = (x if rows > 1 else x.repeat(2, 1)).t()
    return (w @ xt).t()[:rows].contiguous()


def bucket_index(rows: int) -> int:
    """Index into ROW_BUCKETS of the smallest bucket holding `rows` (1 <= rows <= NARROW_MAX_ROWS)."""
    return (rows - 1).bit_length()


def _cpuinfo() -> tuple[str, set[str]]:
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not name and line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif not flags and line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags


def host_key() -> dict[str, object]:
    """What decides which layout wins on this host."""
    name, flags = _cpuinfo()
    return {"cpu": name, "isa": sorted(f for f in ISA_FLAGS if f in flags),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def choices_path(root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(host_key(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root(root) / "cpu-linear" / f"{digest}.json"


def _shape_key(w: torch.Tensor) -> str:
    return f"{str(w.dtype).removeprefix('torch.')} {w.shape[0]}x{w.shape[1]}"


def _pass(fn, xs: dict[int, torch.Tensor], products: Sequence[tuple[str, torch.Tensor]],
          totals: dict[str, float]) -> None:
    for key, w in products:
        x = xs[w.shape[1]]
        t0 = time.perf_counter()
        fn(x, w)
        totals[key] += time.perf_counter() - t0


def measure(products: Sequence[tuple[str, torch.Tensor]], row_counts: Sequence[int], repeats: int = REPEATS,
            first: int = 0) -> list[dict[str, tuple[float, float]]]:
    """Seconds per call of F.linear and of the narrow product, for each row count, by shape key:
    each layout runs through `products` (the model's weights in the order a forward pass
    multiplies by them) once per repeat and row count, every call timed; per key, the fastest
    repeat. Each repeat visits every row count in turn, so the repeats of one row count are spread
    over the whole measurement: a spell in which other processes take a core slows one repeat of
    each row count, not every repeat of one. `first` numbers the first repeat (which layout leads
    alternates with the repeat's number)."""
    dtype = products[0][1].dtype
    widths = {w.shape[1] for _, w in products}
    inputs = [{n: torch.randn(rows, n, dtype=dtype) for n in widths} for rows in row_counts]
    calls = {key: 0 for key, _ in products}
    for key, _ in products:
        calls[key] += 1
    best = [{key: [float("inf"), float("inf")] for key in calls} for _ in row_counts]
    layouts = (F.linear, narrow_linear)
    for i in range(first, first + repeats):
        for xs, fastest in zip(inputs, best):
            # Alternate which goes first, so neither always follows the other's cache footprint.
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                totals = dict.fromkeys(calls, 0.0)
                _pass(layouts[which], xs, products, totals)
                for key, total in totals.items():
                    fastest[key][which] = min(fastest[key][which], total / calls[key])
    return [{key: (a, b) for key, (a, b) in fastest.items()} for fastest in best]


def measured_products(layers: Sequence[Sequence[torch.Tensor]],
                      tail: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The products to time: layer after layer until they hold PASS_BYTES of weights (one layer
    at least), then `tail`. Timing one weight again and again would read it from a cache it fits
    in, where a decode step reads it from memory after every other layer's weights went through;
    two threads read memory faster than one, so hot-cache figures favour a one-thread product
    that the real step does not. Several layers also average out each call's noise."""
    products: list[tuple[str, torch.Tensor]] = []
    held = 0
    for layer in layers:
        for w in layer:
            products.append((_shape_key(w), w))
            held += w.numel() * w.element_size()
        if held >= PASS_BYTES:
            break
    products += [(_shape_key(w), w) for w in tail]
    return products


class CpuLinear:
    """`x @ w^T (+ bias)`, with the layout chosen per weight shape and row bucket."""

    def __init__(self, narrow: dict[tuple[int, int], tuple[bool, ...]]) -> None:
        self.narrow = narrow  # (out, in) -> for each row bucket, whether the narrow product won

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        wins = self.narrow.get(w.shape) if rows <= NARROW_MAX_ROWS else None
        if wins is None or not wins[bucket_index(rows)]:
            return F.linear(x, w, bias)
        y = narrow_linear(x, w)
        return y.add_(bias) if bias is not None else y

    @classmethod
    def for_model(cls, layers: Sequence[Sequence[torch.Tensor]], tail: Sequence[torch.Tensor] = (),
                  root: Path | None = None) -> CpuLinear:
        """Choices for a model's weight shapes: `layers` holds each layer's weights in the order a
        forward pass multiplies by them, `tail` the products after the last layer (the LM head).
        They come from this host's choices file when it has every shape; otherwise they are
        measured (`measure`) and written to it, unless the host was too busy to trust them."""
        path = choices_path(root)
        host = host_key()
        stored = {**_read(path, host), **_unwritten.get(path, {})}
        unique = {_shape_key(w): w for layer in layers for w in layer}
        unique.update({_shape_key(w): w for w in tail})
        if any(key not in stored for key in unique):
            products = measured_products(layers, tail)
            measure(products, [2], repeats=1)  # warm-up: first calls pay for allocations and lazy set-up
            clocks = time.perf_counter(), _waited_s()
            by_rows = measure(products, ROW_BUCKETS, repeats=1)
            # A host too busy for the first repeat to mean anything is not worth the other repeats.
            if _waiting_share(clocks) <= MAX_WAITING_SHARE:
                more = measure(products, ROW_BUCKETS, repeats=REPEATS - 1, first=1)
                by_rows = [{key: (min(a[key][0], b[key][0]), min(a[key][1], b[key][1])) for key in a}
                           for a, b in zip(by_rows, more)]
            wall, waiting = time.perf_counter() - clocks[0], _waiting_share(clocks)
            for key in unique:
                stored[key] = [{"rows": rows, "linear_us": round(1e6 * t[key][0], 2),
                                "narrow_us": round(1e6 * t[key][1], 2), "narrow": t[key][1] < t[key][0]}
                               for rows, t in zip(ROW_BUCKETS, by_rows)]
            _builds.append(path)
            written = False
            if waiting > MAX_WAITING_SHARE:
                log.warning("the host was busy while measuring F.linear against the narrow product (this "
                            "process's threads waited for a core %.0f%% of the time): using the choices for this "
                            "boot only; a later boot measures again", 100 * waiting)
            else:
                log.info("measured F.linear against the narrow product for %d weight shapes in %.2f s on this "
                         "host (%s; threads waited for a core %.0f%% of the time); choices in %s", len(unique),
                         wall, host["cpu"], 100 * waiting, path)
                written = _write(path, host, stored)
                if written:
                    _writes.append(path)
            if not written:
                _unwritten.setdefault(path, {}).update({key: stored[key] for key in unique})
        narrow = {}
        for key, w in unique.items():
            narrow[tuple(w.shape)] = tuple(bool(entry["narrow"]) for entry in stored[key])
            log.debug("cpu linear %s: narrow product at rows %s", key,
                      [r for r, n in zip(ROW_BUCKETS, narrow[tuple(w.shape)]) if n])
        return cls(narrow)


def _waited_s() -> float:
    """Seconds this process's threads have spent runnable but waiting for a core (Linux
    schedstat); 0 where the kernel does not say."""
    total = 0
    try:
        for task in os.scandir("/proc/self/task"):
            with open(os.path.join(task.path, "schedstat")) as f:
                total += int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return total / 1e9


def _waiting_share(since: tuple[float, float]) -> float:
    """Time this process's threads waited for a core since `since` (perf_counter, `_waited_s`),
    over torch's threads x the wall time. Figures measured while other processes held the cores
    are the host's load, not the products', and must not outlive the boot."""
    wall = time.perf_counter() - since[0]
    return (_waited_s() - since[1]) / max(1e-9, wall * torch.get_num_threads())


def _read(path: Path, host: dict[str, object]) -> dict[str, list[dict]]:
    """The stored choices by shape key; empty when there is no file, or it is damaged (logged)
    or written for another host or format."""
    try:
        raw = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("CPU linear choices %s unreadable (%s); measuring again", path, exc)
        return {}
    try:
        if raw["format"] != FORMAT:
            log.info("CPU linear choices %s are of another format; measuring again", path)
            return {}
        if raw["host"] != host:
            raise ValueError("written for another host")  # the file is named by its host's key
        shapes = raw["shapes"]
        for entries in shapes.values():
            if [e["rows"] for e in entries] != list(ROW_BUCKETS) or not all(
                    isinstance(e["narrow"], bool) for e in entries):
                raise ValueError("row buckets differ from this engine's")
        return dict(shapes)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        log.warning("CPU linear choices %s damaged (%s); measuring again", path, exc)
        return {}


def _write(path: Path, host: dict[str, object], shapes: dict[str, list[dict]]) -> bool:
    """Replace the file whole (temporary file, then rename); False when that failed, which only
    costs a later boot the measurement again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT, "host": host, "shapes": shapes}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("could not write the CPU linear choices %s (%s); the next boot will measure again", path, exc)
        return False
    return True

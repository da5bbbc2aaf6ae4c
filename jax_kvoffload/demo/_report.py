"""Text output of `jax-kvoffload demo`: a progress bar for the long steps and the summary."""

from __future__ import annotations

import threading
import time
from typing import TextIO


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB"):
        nbytes /= 1024
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1024:.1f} GiB"


class StreamProgress:
    """`progress(step, done, total)` drawn on a stream (the CLI passes stderr).

    On a terminal it redraws one bar per step in place; otherwise (a log, a pipe) it
    writes one line as a long step starts (`done=0`) and one when a step completes,
    with the step's time from its first call when that is 0.1 s or more. `line(text)`
    writes other lines (the two-process roles' stderr) from any thread.
    """

    def __init__(self, stream: TextIO, width: int = 24) -> None:
        self._stream = stream
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._width = width
        self._started: dict[str, float] = {}
        self._bar = ""  # the bar drawn on the terminal's last line, not ended yet
        self._lock = threading.Lock()

    def __call__(self, step: str, done: int, total: int) -> None:
        now = time.perf_counter()
        with self._lock:
            began = self._started.setdefault(step, now)
            if done >= total:
                del self._started[step]  # a step of the same name later is timed anew
            if self._tty:
                filled = self._width * done // max(total, 1)
                bar = "#" * filled + "." * (self._width - filled)
                self._bar = f"\r  {step:<20} [{bar}] {done}/{total}"
                self._stream.write(self._bar + ("\n" if done >= total else ""))
                if done >= total:
                    self._bar = ""
            elif done >= total:
                took = f", {now - began:.1f} s" if now - began >= 0.1 else ""
                self._stream.write(f"  {step}: done ({total} step{'s' * (total != 1)}{took})\n")
            elif done == 0:
                self._stream.write(f"  {step}: started\n")
            self._stream.flush()

    def line(self, text: str) -> None:
        """Writes one line as it is, above a bar being drawn (which is drawn again)."""
        with self._lock:
            clear = "\r\x1b[K" if self._bar else ""
            self._stream.write(f"{clear}{text}\n{self._bar}")
            self._stream.flush()


def format_summary(s: dict) -> str:
    """The summary table of one `run_scenario` result."""
    m, sc, pf, ck = s["model"], s["scenario"], s["prefill"], s["check"]
    rope = "RoPE" if m["rope"] else "no RoPE"
    rows = [
        ("backend", f"{s['backend']} ({s['device']}), kernels: {sc['kernel_backend']}"),
        (
            "model",
            f"{m['num_layers']} layers, {m['num_heads']} heads / {m['num_kv_heads']} KV heads"
            f" x {m['head_dim']}, {rope}, float32, seed {m['seed']}",
        ),
        (
            "KV cache",
            f"{m.get('cache_layout', 'nhd').upper()} layout, "
            f"block {sc['block_size']} tokens = {_size(s['block_bytes'])}, "
            f"{sc['blocks_per_chunk']} blocks per chunk, host pool {s['host']['chunks']} "
            f"chunks ({_size(s['host']['bytes'])})",
        ),
        (
            "prefix tokens hit",
            f"{s['prefix_hit_tokens']} of {s['requests']['B_tokens']} "
            f"({s['prefix_hit_blocks']} blocks)",
        ),
        (
            "A's blocks reused",
            f"{_yes(s['filler_reused_A_blocks'])} by filler C "
            f"(overwritten: {_yes(s['A_blocks_overwritten'])})",
        ),
        ("stored, device->host", _moved(s["store"])),
        ("loaded, host->device", _moved(s["load"])),
        *_stats_rows(s["stats"]),
        *_tier_rows(s.get("tiers", [])),
        (
            "prefill B with hit",
            f"{pf['with_hit_s'] * 1e3:.1f} ms (load {pf['with_hit_load_s'] * 1e3:.1f} ms, "
            f"{pf['with_hit_tokens_computed']} tokens computed)",
        ),
        (
            "prefill B, no hit",
            f"{pf['full_recompute_s'] * 1e3:.1f} ms "
            f"({pf['full_recompute_tokens_computed']} tokens computed), "
            f"speedup {pf['speedup']:.2f}x",
        ),
        ("logits check", _check(ck, s["prefix_hit_tokens"])),
        ("overall", _overall(s)),
        ("wall time", f"{s['wall_s']:.1f} s (warm-up/compile {pf['warmup_s']:.1f} s)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["jax-kvoffload demo: prefix reuse through host memory", ""]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _stats_rows(st: dict) -> list[tuple[str, str]]:
    """`KVOffloader.stats()` since the warm-up (docs/observability.md)."""
    jobs = "; ".join(
        f"{d} {t['jobs_completed']} ok, {t['jobs_failed']} failed"
        for d, t in (("store", st["store"]), ("load", st["load"]))
    )
    return [
        (
            "chunk lookups",
            f"{st['lookups']}: {st['hits']} hit, {st['hits_pending']} pending, "
            f"{st['misses']} miss ({st['hit_rate']:.0%}); {st['hit_tokens']} tokens hit",
        ),
        (
            "host tier now",
            f"{st['occupied_chunks']} of {st['num_chunks']} chunks hold KV "
            f"({st['occupancy_perc']:.1%}); {st['cpu_cache_usage_perc']:.1%} pinned or being "
            "written (vLLM's usage gauge)",
        ),
        (
            "jobs since warm-up",
            f"{jobs}; {st['evictions']} evicted, {st['stores_dropped']} offers dropped",
        ),
    ]


def _tier_rows(tiers: list[dict]) -> list[tuple[str, str]]:
    """One row per `--tier`: what reached it. Without this, a tier that refused every
    store (a Redis server that is not running) left the summary looking like a success."""
    rows = []
    for t in tiers:
        text = (
            f"{t['cascaded']} chunks cascaded ({_size(t['cascade_bytes'])}), "
            f"{t['cascade_failed']} failed, {t['cascade_dropped']} dropped"
        )
        if t["cascade_failed"] or (t["cascade_dropped"] and not t["cascaded"]):
            text += " (the warning on stderr says why)"
        if not t["check"]["passed"]:
            text += ": FAIL"
        rows.append((f"tier {t['spec']}", text))
    return rows


def _overall(s: dict) -> str:
    """PASS, or FAIL and every reason: the logits check's and each tier's."""
    if s["passed"]:
        return "PASS" + (" (every tier took A's chunks)" if s["tiers"] else "")
    why = [t["check"]["why"] for t in s["tiers"] if not t["check"]["passed"]]
    if not s["check"]["passed"]:
        why.insert(0, s["check"]["why"])
    return "FAIL: " + "; ".join(why)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _moved(t: dict) -> str:
    if not t["blocks"]:
        return "nothing"
    return (
        f"{t['blocks']} blocks, {_size(t['bytes'])} in {t['seconds'] * 1e3:.1f} ms "
        f"({t['gb_per_s']:.2f} GB/s)"
    )


def _check(ck: dict, hit_tokens: int) -> str:
    verdict = "PASS" if ck["passed"] else "FAIL"
    equal = "bit-identical" if ck["logits_equal"] else f"max |diff| {ck['max_abs_diff']:.3g}"
    decode = "equal" if ck["decode_equal"] else "DIFFERENT"
    if not hit_tokens:
        return f"{verdict}: no prefix hit"
    return (
        f"{verdict}: {ck['positions_compared']} suffix positions {equal} to a full "
        f"recompute; decoded tokens {decode} {ck['decoded_tokens']}"
    )


def format_two_process(s: dict) -> str:
    """The summary of `run_two_process`: one row per tier, the ratio last."""
    m, sc = s["model"], s["scenario"]
    lines = [
        "jax-kvoffload demo: a prefix served from a secondary tier by a fresh process",
        "",
        f"  backend {s['backend']}; model {m['num_layers']} layers, {m['num_heads']} heads / "
        f"{m['num_kv_heads']} KV heads x {m['head_dim']}, seed {m['seed']}; prefix "
        f"{sc['prompt_blocks']} blocks of {sc['block_size']} tokens",
    ]
    if s.get("mesh_sizes"):
        w, r = s["mesh_sizes"]
        lines.append(
            f"  writer on a mesh of {w} devices, reader on {r}: canonical pages carry the "
            "prefix across tensor-parallel sizes"
        )
    lines.append("")
    head = ("tier", "writer", "reader hit", "serve prefix", "recompute", "ratio", "logits check")
    rows = []
    for run in s["runs"]:
        w, r = run["writer"], run["reader"] or {}
        if not w.get("passed"):
            failed = f"FAIL {w.get('error', '')}".strip()
            rows.append((run["tier"], failed, "-", "-", "-", "-", "-"))
            continue
        cascaded = sum(t["cascaded"] for t in w.get("tiers", []))
        if "ratio" not in r:
            rows.append((run["tier"], f"{cascaded} chunks", "FAIL", "-", "-", "-",
                         r.get("error", "no reader output")))  # fmt: skip
            continue
        check = "PASS" if r["passed"] else "FAIL"
        equal = "bit-identical" if r["logits_equal"] else f"max |diff| {r['max_abs_diff']:.3g}"
        rows.append((
            run["tier"],
            f"{cascaded} chunks",
            f"{r['prefix_hit_tokens']} tokens",
            f"{r['serve_prefix_s'] * 1e3:.1f} ms",
            f"{r['recompute_prefix_s'] * 1e3:.1f} ms",
            f"{r['ratio']:.2f}x",
            f"{check}: {r['positions_compared']} positions {equal}",
        ))  # fmt: skip
    widths = [max(len(str(x[i])) for x in (head, *rows)) for i in range(len(head))]
    for row in (head, *rows):
        cells = (f"{v!s:<{w}}" for v, w in zip(row, widths, strict=True))
        lines.append(("  " + "  ".join(cells)).rstrip())
    lines += [
        "",
        "  ratio = recompute / serve: how much faster the tier served the prefix than "
        "prefilling it",
        f"  wall time {s['wall_s']:.1f} s; overall: {'PASS' if s['passed'] else 'FAIL'}",
    ]
    return "\n".join(lines)

"""``python -m attnzoo.bench.varlen``: packed variable-length batches (``attnzoo.attention_varlen``) beside the dense
kernel, FlexAttention with a document mask and SDPA on the padded batch, in one run.

The case (issue 26): ``--tokens`` packed tokens (16k) cut into sequences whose lengths are drawn uniformly from
``[--min-len, --max-len]`` (128..4096) with a fixed seed, the last one the remainder (the first seed from ``--seed``
on whose remainder also lies in that range is used, and the lengths are printed and written); ``H = width / D``
heads (width 2048), Nq = Nk per sequence, causal or not.  Per (D, causal):

- ``varlen``: ``triton_2kernel`` on the packed tensors (its packed kernels);
- ``dense``: the same backend on a dense batch at the mean length (``B = tokens // N``): the speed varlen is held to;
- ``varlen_atomic``, ``dense_atomic``: the same for ``triton_atomic`` with ``--backends triton_2kernel,triton_atomic``,
  and likewise for any other backend named there;
- ``flex_document``: FlexAttention on the packed tokens as one sequence ``[1, H, tokens, D]`` with a block mask
  that keeps each token to its own document (and causal within it);
- ``sdpa_padded``: SDPA on the batch padded to the longest sequence, with a key-padding mask (and causal) as a
  boolean ``attn_mask``: the correct padded call; ``sdpa_padded_nomask``: SDPA (flash) on the padded batch with no
  padding mask (padded keys are attended, so its output is wrong): a lower bound of padding's cost.

TFLOP/s count the useful work only, SPEC.md's convention per sequence: ``4 · H · n² · D`` forward (half when
causal), 2.5x that backward, summed over the sequences (the padded and masked work of the peers is not counted).
Times are ``triton.testing.do_bench`` medians after warm-up; the backward is timed alone (on the forward's saved
``o``/``lse``; Flex and SDPA through ``torch.autograd.grad`` on a retained graph).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import random
import sys
from pathlib import Path

import torch

import attnzoo
from attnzoo.bench.modifiers import Flex, _measure, _time_ms
from attnzoo.testing_varlen import cu_seqlens
from attnzoo.varlen import run_varlen_backward, run_varlen_forward, validate_varlen

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
COLUMNS = [
    "table", "impl", "dtype", "d", "causal", "tokens", "sequences", "mean_len", "fwd_ms", "bwd_ms", "fwd_tflops",
    "bwd_tflops", "status", "lengths",
]  # fmt: skip


def draw_lengths(tokens: int, low: int, high: int, seed: int) -> tuple[list[int], int]:
    """Lengths uniform in ``[low, high]`` summing to ``tokens`` (the last one the remainder), from the first seed from
    ``seed`` on whose remainder lies in ``[low, high]`` too -> (lengths, that seed)."""
    for attempt in range(seed, seed + 1000):
        rng = random.Random(attempt)
        lengths = []
        while tokens - sum(lengths) > high:
            lengths.append(rng.randint(low, high))
        remainder = tokens - sum(lengths)
        if low <= remainder <= high:
            return [*lengths, remainder], attempt
    raise ValueError(f"no seed in [{seed}, {seed + 1000}) gives lengths in [{low}, {high}] summing to {tokens}")


def useful_flops(lengths: list[int], heads: int, d: int, causal: bool) -> float:
    """SPEC.md's forward FLOPs summed over the sequences: ``4 · H · n² · D`` each, half when causal."""
    return sum(4.0 * heads * n * n * d * (0.5 if causal else 1.0) for n in lengths)


def _randn(shape, dtype, gen):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def impl_names(backend: str) -> tuple[str, str]:
    """The CSV's impl names of ``backend``'s packed and dense rows: ``varlen``/``dense`` for ``triton_2kernel``,
    ``varlen_atomic``/``dense_atomic`` for ``triton_atomic``."""
    suffix = "" if backend == "triton_2kernel" else "_" + backend.removeprefix("triton_")
    return f"varlen{suffix}", f"dense{suffix}"


def _varlen_times(name, q, k, v, do, cu, max_len, causal) -> tuple[float, float]:
    backend = attnzoo.get(name)
    problem = validate_varlen(q, k, v, cu, cu, max_len, max_len, causal)
    o, lse = run_varlen_forward(backend, q, k, v, problem)
    run_varlen_backward(backend, do, q, k, v, o, lse, problem)  # compile and pick the configs outside the timing
    fwd = _time_ms(lambda: run_varlen_forward(backend, q, k, v, problem))
    bwd = _time_ms(lambda: run_varlen_backward(backend, do, q, k, v, o, lse, problem))
    return fwd, bwd


def _dense_times(name, q, k, v, do, causal) -> tuple[float, float]:
    backend = attnzoo.get(name)
    o, lse = backend.forward(q, k, v, causal=causal)
    backend.backward(do, q, k, v, o, lse, causal=causal)
    fwd = _time_ms(lambda: backend.forward(q, k, v, causal=causal))
    bwd = _time_ms(lambda: backend.backward(do, q, k, v, o, lse, causal=causal))
    return fwd, bwd


def _document_mask(lengths: list[int], causal: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    document = torch.repeat_interleave(
        torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda")
    )  # fmt: skip

    def mask_mod(b, h, q_idx, kv_idx):
        same = document[q_idx] == document[kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    total = sum(lengths)
    return create_block_mask(mask_mod, None, None, total, total, device="cuda")


def _flex_times(flex: Flex, q, k, v, do, block_mask) -> tuple[float, float]:
    # q, k, v, do packed [total, H, D] -> one sequence [1, H, total, D].
    q, k, v, do = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v, do))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.no_grad():
        flex.run(q, k, v, block_mask=block_mask)
    fwd = _time_ms(lambda: flex.run(q, k, v, block_mask=block_mask))
    out = flex.run(*leaves, block_mask=block_mask)
    torch.autograd.grad(out, leaves, do, retain_graph=True)
    bwd = _time_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    return fwd, bwd


def _padded(x: torch.Tensor, lengths: list[int], n_max: int) -> torch.Tensor:
    """Packed ``[total, H, D]`` -> padded ``[B, H, n_max, D]`` (zeros past each sequence)."""
    out = x.new_zeros((len(lengths), x.shape[1], n_max, x.shape[2]))
    start = 0
    for b, n in enumerate(lengths):
        out[b, :, :n] = x[start : start + n].transpose(0, 1)
        start += n
    return out


def _sdpa_times(q, k, v, do, attn_mask, causal) -> tuple[float, float]:
    import torch.nn.functional as F

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    is_causal = causal and attn_mask is None

    def forward(*xs):
        return F.scaled_dot_product_attention(*xs, attn_mask=attn_mask, is_causal=is_causal)

    with torch.no_grad():
        forward(q, k, v)
    fwd = _time_ms(lambda: forward(q, k, v))
    out = forward(*leaves)
    torch.autograd.grad(out, leaves, do, retain_graph=True)
    bwd = _time_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    return fwd, bwd


def run(args: argparse.Namespace, on_row=None) -> list[dict]:
    """Measure every case; ``on_row(row)`` is called as each row is complete (the CSV is written as it goes)."""
    lengths, seed = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    n_max, mean_len = max(lengths), round(sum(lengths) / len(lengths))
    print(f"lengths (seed {seed}, {len(lengths)} sequences, mean {mean_len}, longest {n_max}): {lengths}")
    flex = Flex()
    rows: list[dict] = []
    lengths_text = " ".join(map(str, lengths))
    for dtype_name in args.dtype.split(","):
        dtype = DTYPES[dtype_name]
        for d in args.d:
            heads = max(1, args.width // d)
            gen = torch.Generator(device="cuda").manual_seed(d)
            q, k, v, do = (_randn((args.tokens, heads, d), dtype, gen) for _ in range(4))
            cu = cu_seqlens(lengths, "cuda")
            dense_n = mean_len
            dense = [_randn((max(1, args.tokens // dense_n), heads, dense_n, d), dtype, gen) for _ in range(4)]
            padded = [_padded(x, lengths, n_max) for x in (q, k, v, do)]
            key_padding = torch.arange(n_max, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
            for causal in (False, True):
                flops = useful_flops(lengths, heads, d, causal)
                dense_flops = useful_flops([dense_n] * max(1, args.tokens // dense_n), heads, d, causal)
                mask = key_padding[:, None, None, :]
                if causal:  # bottom-right = top-left here (Nq = Nk per sequence)
                    mask = mask & torch.ones(n_max, n_max, dtype=torch.bool, device="cuda").tril()
                case = dict(dtype=dtype_name, d=d, causal=causal, tokens=args.tokens, sequences=len(lengths),
                            mean_len=mean_len)  # fmt: skip
                block_mask = _document_mask(lengths, causal)
                measured = []
                for backend in args.backends:
                    packed_name, dense_name = impl_names(backend)
                    measured.append((packed_name, flops, _varlen_times, (backend, q, k, v, do, cu, n_max, causal)))
                    measured.append((dense_name, dense_flops, _dense_times, (backend, *dense, causal)))
                measured += [
                    ("flex_document", flops, lambda *a: _flex_times(flex, *a), (q, k, v, do, block_mask)),
                    ("sdpa_padded", flops, _sdpa_times, (*padded, mask, causal)),
                    ("sdpa_padded_nomask", flops, _sdpa_times, (*padded, None, causal)),
                ]
                for impl, impl_flops, times_of, impl_args in measured:
                    _measure(rows, "varlen", impl, case, times_of, *impl_args)
                    row = rows[-1]
                    row["lengths"] = lengths_text
                    row["fwd_tflops"] = impl_flops / row["fwd_ms"] * 1e-9
                    row["bwd_tflops"] = 2.5 * impl_flops / row["bwd_ms"] * 1e-9
                    if on_row is not None:
                        on_row(row)
                torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> str:
    """Each backend's packed TFLOP/s against each peer (its own dense rows for ``vs dense``), per (dtype, D,
    causal): ratios above 1 are the packed call faster."""
    lines = ["impl dtype d causal | fwd/bwd TFLOP/s | vs dense | vs flex_document | vs sdpa_padded | vs nomask"]
    cases = sorted({(r["dtype"], r["d"], r["causal"]) for r in rows}, key=str)
    packed = sorted({r["impl"] for r in rows if r["impl"].startswith("varlen")})
    for case in cases:
        by_impl = {r["impl"]: r for r in rows if (r["dtype"], r["d"], r["causal"]) == case}
        for impl in packed:
            ours = by_impl.get(impl)
            if ours is None:
                continue
            cells = [f"{ours['fwd_tflops']:.0f}/{ours['bwd_tflops']:.0f}"]
            for peer in ("dense" + impl.removeprefix("varlen"), "flex_document", "sdpa_padded", "sdpa_padded_nomask"):
                other = by_impl.get(peer)
                if other is None:
                    cells.append("-")
                    continue
                cells.append(
                    f"{ours['fwd_tflops'] / other['fwd_tflops']:.2f}/{ours['bwd_tflops'] / other['bwd_tflops']:.2f}"
                )
            lines.append(f"{impl} {case[0]} {case[1]} {case[2]} | " + " | ".join(cells))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Bars of forward and backward TFLOP/s per implementation, one panel per (D, causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["d"], r["causal"]) for r in rows})
    ours = [impl for impl in dict.fromkeys(r["impl"] for r in rows) if impl.startswith(("varlen", "dense"))]
    impls = [*ours, "flex_document", "sdpa_padded", "sdpa_padded_nomask"]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4), squeeze=False)
    for ax, (d, causal) in zip(axes[0], cases, strict=True):
        by_impl = {r["impl"]: r for r in rows if (r["d"], r["causal"]) == (d, causal)}
        xs = range(len(impls))
        fwd = [by_impl[i]["fwd_tflops"] if i in by_impl else 0 for i in impls]
        bwd = [by_impl[i]["bwd_tflops"] if i in by_impl else 0 for i in impls]
        ax.bar([x - 0.2 for x in xs], fwd, width=0.4, label="forward")
        ax.bar([x + 0.2 for x in xs], bwd, width=0.4, label="backward")
        ax.set_xticks(list(xs), [i.replace("_", "\n") for i in impls], fontsize=7)
        ax.set_title(f"D={d}, {'causal' if causal else 'full'}", fontsize=9)
        ax.set_ylabel("useful TFLOP/s")
    axes[0][0].legend(fontsize=7)
    dtype = rows[0]["dtype"] if rows else ""
    fig.suptitle(f"packed varlen batch, {rows[0]['tokens'] if rows else ''} tokens, {dtype}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m attnzoo.bench.varlen", description=__doc__.split("\n\n")[0])
    cli.add_argument("--tokens", type=int, default=16384, help="packed tokens (default 16384)")
    cli.add_argument("--min-len", type=int, default=128)
    cli.add_argument("--max-len", type=int, default=4096)
    cli.add_argument("--seed", type=int, default=0, help="seed of the lengths (the first good one from here on)")
    cli.add_argument("--d", type=lambda t: [int(x) for x in t.split(",")], default=[64, 128], help="head dims")
    cli.add_argument("--width", type=int, default=2048, help="H * D")
    cli.add_argument("--dtype", default="bf16", help="fp16, bf16 or both (comma-separated)")
    cli.add_argument(
        "--backends", type=lambda t: t.split(","), default=["triton_2kernel"],
        help="attnzoo backends to time, packed and dense (comma-separated; default triton_2kernel)",
    )  # fmt: skip
    cli.add_argument("--out", type=Path, help="CSV to write")
    cli.add_argument("--plot", type=Path, help="PNG to write")
    cli.add_argument(
        "--autotune", action="store_true",
        help="time every candidate config of each key first (the [tuned] lines can feed bench/ship_tuning.py)",
    )  # fmt: skip
    args = cli.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m attnzoo.bench.varlen: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = open(args.out, "w", newline="") if args.out else None  # noqa: SIM115  (written row by row)
    writer = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore") if out else None
    if writer:
        writer.writeheader()

    def write(row: dict) -> None:
        if writer:
            writer.writerow(row)
            out.flush()

    from attnzoo.kernels import tuning

    try:
        with tuning.autotuning(True) if args.autotune else contextlib.nullcontext():
            rows = run(args, write)
    finally:
        if out:
            out.close()
    if args.plot:
        plot(rows, args.plot)
    print(summary(rows))
    for line in tuning.tuned_report().values():  # each timed key's candidates, fastest first
        print(f"[tuned] {line}")
    for key, (cfg, source) in tuning.chosen_configs().items():
        print(f"[config] {key}: {cfg} ({source})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

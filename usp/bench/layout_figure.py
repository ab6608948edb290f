"""The picture in docs/attention.md: which tokens land on which ring rank, zigzag vs balanced.

    python -m usp.bench.layout_figure --out docs/figures/ring_layouts.png

For each mixture (a row of packed documents, ``--doc-lengths`` specs) and layout, one strip: the row's
positions left to right, coloured by the ring rank that holds them, document boundaries marked above; next to
it, each rank's causal in-document attention work (exact pairs, :func:`usp.parallel.ring_rank_pairs`)
relative to the mean.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from usp.bench.flags import comma_ring_layouts
from usp.data.doc_lengths import boundaries, parse_doc_lengths
from usp.parallel import ring_pieces, ring_rank_pairs

DEFAULT_MIXTURES = ("lengths:128,4096,128x31", "lognormal:mean=512,sigma=1.0,seed=0")


def draw(
    out: str, *, seq_len: int, ring_degree: int, mixtures: Sequence[str], layouts: Sequence[str]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(spec, layout) for spec in mixtures for layout in layouts]
    fig, axes = plt.subplots(
        len(rows),
        2,
        figsize=(12, 1.25 * len(rows) + 0.8),
        gridspec_kw={"width_ratios": [6, 1]},
        squeeze=False,
    )
    colors = plt.get_cmap("tab10").colors
    for (spec, layout), (strip, bars) in zip(rows, axes):
        cu = boundaries(parse_doc_lengths(spec).row(seq_len))
        for rank, pieces in enumerate(ring_pieces(seq_len, ring_degree, layout, cu)):
            strip.broken_barh(
                [(int(a), int(b - a)) for a, b in pieces], (0, 1), facecolors=colors[rank % len(colors)]
            )
        strip.vlines(cu, 1.0, 1.35, color="black", linewidth=0.6)
        strip.set_xlim(0, seq_len)
        strip.set_ylim(0, 1.4)
        strip.set_yticks([])
        strip.set_title(
            f"{layout}: {spec} ({len(cu) - 1} documents, ticks = boundaries)", fontsize=9, loc="left"
        )
        pairs = np.asarray(ring_rank_pairs(seq_len, ring_degree, layout, cu), dtype=float)
        rel = pairs / pairs.mean()
        bars.bar(range(ring_degree), rel, color=[colors[r % len(colors)] for r in range(ring_degree)])
        bars.axhline(1.0, color="black", linewidth=0.6)
        bars.set_ylim(0, max(2.0, rel.max() * 1.1))
        bars.set_xticks(range(ring_degree))
        bars.set_title(f"work / mean, max {rel.max():.2f}", fontsize=9)
    axes[-1][0].set_xlabel(
        f"position in the packed row (S = {seq_len}); colour = ring rank (R = {ring_degree})"
    )
    axes[-1][1].set_xlabel("ring rank")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m usp.bench.layout_figure", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", default="docs/figures/ring_layouts.png")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--ring", type=int, default=4)
    p.add_argument("--doc-lengths", action="append", default=None, metavar="SPEC")
    p.add_argument("--layouts", type=comma_ring_layouts, default="zigzag,balanced")
    args = p.parse_args(argv)
    draw(
        args.out,
        seq_len=args.seq,
        ring_degree=args.ring,
        mixtures=args.doc_lengths or DEFAULT_MIXTURES,
        layouts=args.layouts,
    )


if __name__ == "__main__":
    main()

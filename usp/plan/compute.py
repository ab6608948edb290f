"""FLOPs of a training step and how long one rank spends on them.

Conventions (2 FLOPs per multiply-add):

- dense: ``2 * matmul_params`` per token forward, ``6 *`` for forward + backward;
- attention, forward, one layer, a sequence of ``S`` tokens: ``4 * S^2 * H * d`` without a mask (``Q K^T`` and
  ``P V``), half of it causal; the backward costs 2.5 forwards in a fused kernel (it recomputes ``P``), the
  model-FLOP count (for MFU) uses 2;
- activation checkpointing recomputes the forward of the checkpointed layers (hardware FLOPs, not model FLOPs).

Causal work per rank of a ring of ``N`` (tile-level masking, diagonal blocks cost half):
zigzag gives every rank ``N/2`` block-equivalents, perfectly balanced; contiguous makes the last rank wait
``N - 1/2`` of them, so its imbalance is ``(2N - 1) / N``. A block-level count takes diagonal blocks as whole
blocks and gets ``4N / (2N + 1)`` for the zigzag speedup (:func:`seed_zigzag_speedup`); both are 1.88 at N=8.

Packed documents (``usp-plan --doc-lengths SPEC``, :class:`DocumentWork`): attention never crosses a
document, so a row costs ``sum_i d_i (d_i + 1) / 2`` causal pairs instead of ``S (S + 1) / 2``, and the
busiest ring rank's share depends on the layout: the exact per-rank pair counts of rows drawn from the
distribution (:func:`usp.parallel.ring_rank_pairs`) give both factors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from usp.plan.hardware import DeviceSpec
from usp.plan.models import ModelSpec

ATTN_BWD_OVER_FWD_HW = 2.5
ATTN_BWD_OVER_FWD_MODEL = 2.0


def attention_fwd_flops(
    model: ModelSpec, q_tokens: float, kv_tokens: float, heads: int | None = None
) -> float:
    """Unmasked attention FLOPs of one layer: ``4 * q * kv * heads * head_dim`` (per ring step)."""
    h = model.num_heads if heads is None else heads
    return 4.0 * q_tokens * kv_tokens * h * model.head_dim


def causal_imbalance(ring_degree: int, ring_layout: str = "zigzag") -> float:
    """Busiest rank's causal attention work over the balanced share ``S^2 / 2 / N`` (1 = balanced), one
    sequence (``balanced`` is zigzag without documents)."""
    n = ring_degree
    if ring_layout in ("zigzag", "balanced") or n == 1:
        return 1.0
    if ring_layout == "contiguous":
        return (2 * n - 1) / n
    raise ValueError(f"ring_layout={ring_layout!r} is invalid; choose zigzag, contiguous or balanced.")


@dataclass
class DocumentWork:
    """Attention work of packed rows whose documents follow a length distribution (``--doc-lengths``).

    ``rows``: sampled rows' document lengths (each sums to ``seq_len``). ``pair_fraction`` is their mean causal
    in-document pairs over one causal sequence's; :meth:`imbalance` the mean busiest-ring-rank work over the
    mean, exact per row and layout.
    """

    spec: str
    seq_len: int
    rows: list[list[int]]
    _imbalance: dict[tuple[int, str], float] = field(default_factory=dict, repr=False)

    @classmethod
    def from_spec(cls, spec: str, seq_len: int, num_rows: int = 16) -> DocumentWork:
        from usp.data.doc_lengths import parse_doc_lengths  # one parser for usp-bench and usp-plan

        dist = parse_doc_lengths(spec)
        return cls(spec, seq_len, [dist.row(seq_len, i).tolist() for i in range(num_rows)])

    @property
    def pair_fraction(self) -> float:
        whole = self.seq_len * (self.seq_len + 1) / 2
        return sum(sum(d * (d + 1) / 2 for d in row) for row in self.rows) / len(self.rows) / whole

    def imbalance(self, ring_degree: int, ring_layout: str) -> float:
        key = (ring_degree, ring_layout)
        if key not in self._imbalance:
            import numpy as np

            from usp.parallel import ring_rank_pairs

            ratios = []
            for row in self.rows:
                cu = np.concatenate([[0], np.cumsum(row)]).astype(np.int64)
                pairs = ring_rank_pairs(self.seq_len, ring_degree, ring_layout, cu)
                mean = sum(pairs) / len(pairs)
                ratios.append(max(pairs) / mean if mean else 1.0)
            self._imbalance[key] = sum(ratios) / len(ratios)
        return self._imbalance[key]


def seed_zigzag_speedup(ring_degree: int) -> float:
    """The seed's block-count speedup of zigzag over contiguous: ``N / ((2N + 1) / 4) = 4N / (2N + 1)``."""
    n = ring_degree
    return 4 * n / (2 * n + 1)


def model_flops_per_token(model: ModelSpec, seq_len: int, documents: DocumentWork | None = None) -> float:
    """Training FLOPs per token used for MFU: ``6 * matmul_params`` + causal attention (fwd + 2x bwd), over
    the packed ``documents`` when given."""
    dense = 6.0 * model.matmul_params
    attn_fwd = attention_fwd_flops(model, 1, seq_len) / 2 * model.num_layers  # causal: average key count S/2
    if documents is not None:
        attn_fwd *= documents.pair_fraction
    return dense + attn_fwd * (1 + ATTN_BWD_OVER_FWD_MODEL)


def block_efficiency(flops_per_call: float, device: DeviceSpec) -> float:
    """Attention kernel efficiency for a call of ``flops_per_call``: saturates for large blocks."""
    half = device.attention_half_s * device.peak_flops
    return device.attention_efficiency * flops_per_call / (flops_per_call + half)


def compute_time(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    ulysses_degree: int,
    ring_degree: int,
    ring_layout: str = "zigzag",
    recompute_layers: float = 0.0,
    mlp_recompute_layers: float = 0.0,
    documents: DocumentWork | None = None,
) -> dict[str, float]:
    """Seconds one rank computes per micro step (one sequence sharded over ``ulysses x ring`` ranks).

    ``recompute_layers``: how many decoder layers run their forward twice (activation checkpointing);
    ``mlp_recompute_layers``: how many run their MLP forward once more (a tiled MLP recomputes its tiles).
    ``documents``: packed rows of that length distribution (attention over documents, the busiest ring rank's
    share in ``ring_layout``); ``None``: one causal sequence, an upper bound.
    Returns ``dense_s``, ``attention_s``, ``overhead_s``, ``ring_step_flops`` (one rank's attention FLOPs per
    ring step and layer, forward) and ``hw_flops`` (what the rank executes).
    """
    sp = ulysses_degree * ring_degree
    local_tokens = seq_len / sp
    L = model.num_layers
    layer_frac = model.num_layers * model.layer_params / model.matmul_params
    dense_flops = 6.0 * model.matmul_params * local_tokens
    dense_flops += 2.0 * model.matmul_params * local_tokens * layer_frac * recompute_layers / L
    dense_flops += 2.0 * 3 * model.hidden_size * model.intermediate_size * local_tokens * mlp_recompute_layers
    # Attention forward of one layer on one rank: the causal share of S^2, times the layout's imbalance.
    if documents is None:
        share = causal_imbalance(ring_degree, ring_layout)
    else:  # the row's in-document pairs, the busiest ring rank's share of them
        share = documents.pair_fraction * documents.imbalance(ring_degree, ring_layout)
    attn_fwd_layer = attention_fwd_flops(model, seq_len, seq_len) / 2 / sp * share
    attn_fwd_layer *= model.ulysses_head_imbalance(ulysses_degree)  # uneven heads: the busiest rank's share
    passes = 1 + ATTN_BWD_OVER_FWD_HW
    attn_flops = attn_fwd_layer * (passes * L + recompute_layers)
    # One kernel call per ring step: S/R queries against S/R keys (half of that in zigzag steps), H/U heads
    # (the busiest rank's ceil(H/U) when uneven).
    heads = model.q_heads_per_rank(ulysses_degree)
    block = seq_len / ring_degree
    step_flops = attention_fwd_flops(model, block, block, heads) / 2
    eff = block_efficiency(step_flops, device)
    peak = device.peak_flops
    return {
        "dense_s": dense_flops / (peak * device.dense_efficiency),
        "attention_s": attn_flops / (peak * eff),
        "overhead_s": device.layer_overhead_s * L,
        "ring_step_flops": step_flops,
        "hw_flops": dense_flops + attn_flops,
    }

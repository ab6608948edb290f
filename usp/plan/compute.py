"""Model FLOPs of a training step, MFU, and how long one rank spends on the FLOPs.

Conventions (2 FLOPs per multiply-add):

- dense: ``2 * matmul_params`` per token forward, ``6 *`` for forward + backward (``matmul_params``: the weights
  of every linear layer and the LM head, tied or not; not the input embedding, a lookup, nor the RMSNorm
  weights: :attr:`usp.plan.models.ModelSpec.matmul_params`, counted from a real model by
  :func:`usp.train.flops.count_matmul_params`);
- attention, forward, one layer: ``4 * H * d`` per (query, key) pair (``Q K^T`` and ``P V``); a causal
  document of ``s`` tokens has ``s (s + 1) / 2`` pairs (:func:`attention_pairs`), and attention never crosses
  a packed document; the backward costs 2.5 forwards in a fused kernel (it recomputes ``P``), the model-FLOP
  count (for MFU) uses 2;
- activation checkpointing recomputes the forward of the checkpointed layers (hardware FLOPs, not model FLOPs);
- mixture of experts: ``matmul_params`` counts the parameters one token goes through (attention, the router
  ``E h``, its ``k`` experts, the shared experts, the LM head), not the experts it is not routed to, so MFU is
  ``6 x active x tokens + attention`` over the peak; the grouped expert matmuls are costed at the dense
  efficiency. Where transformers runs every expert on every token (Llama 4,
  :attr:`usp.plan.models.MoESpec.every_expert_runs`) the time counts what runs,
  :attr:`usp.plan.models.ModelSpec.executed_matmul_params` (the idle experts too), and MFU still the active
  ``matmul_params``.

Model FLOPs (:func:`training_flops`, the one count the trainer's ``metrics.jsonl``, ``usp.bench.throughput``
and the planner's MFU use): ``6 * matmul_params * tokens + 12 * L * H * d * pairs``; MFU (:func:`mfu`): model
FLOP/s per device over its dense peak. LoRA on a frozen base (:mod:`usp.plan.lora`): a matmul weight costs
``2`` forward and ``2`` for its input gradient per token, and ``2`` more for its weight gradient only when it
trains, so ``(4 * matmul_params + 2 * trainable_matmul_params) * tokens`` (``4 N_frozen + 6 N_trainable``,
``matmul_params`` counting the adapters too) with the same attention term.

Causal work per rank of a ring of ``N`` (tile-level masking, diagonal blocks cost half):
zigzag gives every rank ``N/2`` block-equivalents, perfectly balanced; contiguous makes the last rank wait
``N - 1/2`` of them, so its imbalance is ``(2N - 1) / N``. A block-level count takes diagonal blocks as whole
blocks and gets ``4N / (2N + 1)`` for the zigzag speedup (:func:`seed_zigzag_speedup`); both are 1.88 at N=8.

Packed documents (``usp-plan --doc-lengths SPEC``, :class:`DocumentWork`): a row costs ``sum_i d_i (d_i + 1) /
2`` causal pairs instead of ``S (S + 1) / 2``, and the busiest ring rank's share depends on the layout: the
exact per-rank pair counts of rows drawn from the distribution (:func:`usp.parallel.ring_rank_pairs`) give
both factors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from usp.plan.hardware import DeviceSpec
from usp.plan.lora import LoraPlan, adapted_linears, adapter_params
from usp.plan.lora import matmul_params as lora_matmul_params
from usp.plan.lora import trainable_matmul_params as lora_trainable_matmul_params
from usp.plan.mixers import MIXER_BWD_OVER_FWD
from usp.plan.models import ModelSpec

ATTN_BWD_OVER_FWD_HW = 2.5
ATTN_BWD_OVER_FWD_MODEL = 2.0


def attention_fwd_flops(
    model: ModelSpec, q_tokens: float, kv_tokens: float, heads: int | None = None
) -> float:
    """Unmasked attention FLOPs of one layer: ``4 * q * kv * heads * head_dim`` (per ring step)."""
    h = model.num_heads if heads is None else heads
    return 4.0 * q_tokens * kv_tokens * h * model.head_dim


LayerAttention = tuple[int | None, int | None]
"""One layer's ``(sliding window, chunk)`` in tokens (``None``: not limited); ``(None, None)`` is full causal."""


def _causal_pairs(s: int, window: int | None) -> int:
    """Causal pairs of ``s`` tokens when a query sees at most ``window`` keys (itself included)."""
    if window is None or s <= window:
        return s * (s + 1) // 2
    return window * (window + 1) // 2 + (s - window) * window


def attention_pairs(
    document_lengths: Sequence[Sequence[int]],
    causal: bool = True,
    window: int | None = None,
    chunk: int | None = None,
) -> float:
    """(query, key) pairs attention scores over sequences of packed documents (per sequence, its document
    lengths): ``s (s + 1) / 2`` per document of ``s`` tokens when ``causal`` (every key up to and including
    the query's position), ``s^2`` otherwise. A sliding ``window`` caps a query's keys at ``window``; a
    ``chunk`` splits each document into ``chunk``-token pieces that attend only inside themselves (both as
    usp's attention computes them, causal only). Raises ``ValueError`` on a negative length."""
    lengths = [s for seq in document_lengths for s in seq]
    if any(s < 0 for s in lengths):
        raise ValueError(f"document lengths must be >= 0, got {document_lengths}")
    if not causal:
        return float(sum(s * s for s in lengths))
    if chunk is None:
        return float(sum(_causal_pairs(s, window) for s in lengths))
    total = 0
    for s in lengths:
        full, rest = divmod(s, chunk)
        total += full * _causal_pairs(chunk, window) + _causal_pairs(rest, window)
    return float(total)


def layer_pairs(
    document_lengths: Sequence[Sequence[int]], layer_attention: Sequence[LayerAttention], num_layers: int
) -> float:
    """Causal pairs summed over the layers: each layer's own window / chunk (``layer_attention``, one entry per
    layer), or ``num_layers`` full causal layers when it is empty."""
    if not layer_attention:
        return num_layers * attention_pairs(document_lengths)
    assert len(layer_attention) == num_layers, "one (window, chunk) per layer"
    memo: dict[LayerAttention, float] = {}
    for key in layer_attention:
        if key not in memo:
            memo[key] = attention_pairs(document_lengths, True, *key)
    return float(sum(memo[key] for key in layer_attention))


def training_flops(
    *,
    matmul_params: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    document_lengths: Sequence[Sequence[int]],
    causal: bool = True,
    layer_attention: Sequence[LayerAttention] = (),
    trainable_matmul_params: int | None = None,
) -> float:
    """Model FLOPs of one forward + backward over ``document_lengths`` (per sequence, its packed documents):
    ``6 * matmul_params * tokens + 12 * num_heads * head_dim * sum over layers of pairs``
    (:func:`attention_pairs`; ``layer_attention``: each layer's sliding window and chunk, so a windowed layer
    counts the pairs it attends, not the full causal ones; empty: ``num_layers`` full causal layers).

    ``trainable_matmul_params``: of the ``matmul_params``, those that get a weight gradient (LoRA: the adapters,
    and a tied LM head when the embeddings train; ``matmul_params`` then counts the adapters too). The matmuls
    then count ``(4 * matmul_params + 2 * trainable_matmul_params) * tokens`` (forward, input gradients, weight
    gradients of the trainable ones); ``None``: every weight trains, ``6 * matmul_params * tokens``.

    ``num_heads`` counts query heads (GQA shares K/V, not the score matmuls). Recomputation is not counted.
    """
    if min(matmul_params, num_layers, num_heads, head_dim) < 0:
        raise ValueError("training_flops: matmul_params, num_layers, num_heads and head_dim must be >= 0")
    if trainable_matmul_params is not None and not 0 <= trainable_matmul_params <= matmul_params:
        raise ValueError(
            f"training_flops: trainable_matmul_params={trainable_matmul_params} must be in [0, matmul_params="
            f"{matmul_params}]"
        )
    if causal:
        pairs = layer_pairs(document_lengths, layer_attention, num_layers)
    else:
        pairs = num_layers * attention_pairs(document_lengths, causal)
    tokens = sum(s for seq in document_lengths for s in seq)
    passes = 1 + ATTN_BWD_OVER_FWD_MODEL
    if trainable_matmul_params is None:
        return passes * (2.0 * matmul_params * tokens + 4.0 * num_heads * head_dim * pairs)
    dense = (4.0 * matmul_params + 2.0 * trainable_matmul_params) * tokens
    return dense + passes * 4.0 * num_heads * head_dim * pairs


def mfu(flops: float, step_time_s: float, world_size: int, peak_flops: float) -> tuple[float, float]:
    """``(flops_per_gpu_s, mfu)`` of a step of ``flops`` model FLOPs (all devices together) in ``step_time_s``
    seconds over ``world_size`` devices of ``peak_flops`` dense FLOP/s each."""
    per_gpu = flops / step_time_s / world_size
    return per_gpu, per_gpu / peak_flops


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
        return attention_pairs(self.rows) / len(self.rows) / attention_pairs([[self.seq_len]])

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


def model_flops_per_token(
    model: ModelSpec, seq_len: int, documents: DocumentWork | None = None, lora: LoraPlan | None = None
) -> float:
    """Training FLOPs per token used for MFU (:func:`training_flops` of one causal sequence of ``seq_len``, or
    of the packed ``documents``' rows, over their tokens); with ``lora``, the adapters' matmuls and only the
    trainable weights' gradients (:func:`usp.plan.lora.trainable_matmul_params`)."""
    rows = [[seq_len]] if documents is None else documents.rows
    flops = training_flops(
        matmul_params=lora_matmul_params(model, lora),
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        head_dim=model.head_dim,
        document_lengths=rows,
        layer_attention=model.layer_attention,
        trainable_matmul_params=lora_trainable_matmul_params(model, lora),
    )
    return flops / (len(rows) * seq_len)


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
    lora: LoraPlan | None = None,
) -> dict[str, float]:
    """Seconds one rank computes per micro step (one sequence sharded over ``ulysses x ring`` ranks).

    ``recompute_layers``: how many decoder layers run their forward twice (activation checkpointing);
    ``mlp_recompute_layers``: how many run their MLP forward once more (a tiled MLP recomputes its tiles).
    ``documents``: packed rows of that length distribution (attention over documents, the busiest ring rank's
    share in ``ring_layout``); ``None``: one causal sequence, an upper bound. ``lora``: adapters on a frozen
    base (the adapters' matmuls run too; only the trainable weights' gradients are computed: module docstring).
    Returns ``dense_s``, ``attention_s``, ``mixer_s`` (a hybrid's mixer layers: :func:`mixer_flops`),
    ``overhead_s``, ``ring_step_flops`` (one rank's attention FLOPs per ring step and layer, forward) and
    ``hw_flops`` (what the rank executes).
    """
    sp = ulysses_degree * ring_degree
    local_tokens = seq_len / sp
    L = model.num_layers
    if lora is None:
        dense_flops = (
            6.0 * model.executed_matmul_params * local_tokens
        )  # = matmul_params unless idle experts run
        dense_flops += 2.0 * model.executed_layer_matmul_params * local_tokens * recompute_layers
        dense_flops += (
            2.0 * 3 * model.hidden_size * model.intermediate_size * local_tokens * mlp_recompute_layers
        )
    else:  # every weight forward and input gradient, the trainable ones' weight gradients; the adapters run too
        adapters = adapter_params(model, lora)
        trainable = lora_trainable_matmul_params(model, lora) or 0
        dense_flops = (4.0 * (model.executed_matmul_params + adapters) + 2.0 * trainable) * local_tokens
        layer = model.executed_layer_matmul_params + adapters / L  # the mean layer, as executed_layer_...
        dense_flops += 2.0 * layer * local_tokens * recompute_layers
        mlp = 3 * model.hidden_size * model.intermediate_size + sum(
            lora.rank * (i + o)
            for name, (i, o) in adapted_linears(model, lora).items()
            if name in ("gate_proj", "up_proj", "down_proj")
        )
        dense_flops += 2.0 * mlp * local_tokens * mlp_recompute_layers
    # Attention forward of one layer on one rank: the causal pairs of the row over the ranks, times the
    # busiest rank's share
    # (the mean over layers: a windowed or chunked layer counts the pairs it attends; its ring share is taken
    # as the causal one, an upper bound under zigzag, whereas a contiguous window is nearly balanced)
    if documents is None:
        pairs = layer_pairs([[seq_len]], model.layer_attention, L) / L
        share = causal_imbalance(ring_degree, ring_layout)
    else:  # the rows' in-document pairs, the busiest ring rank's share of them
        pairs = layer_pairs(documents.rows, model.layer_attention, L) / L / len(documents.rows)
        share = documents.imbalance(ring_degree, ring_layout)
    attn_fwd_layer = 4.0 * pairs * model.num_heads * model.head_dim / sp * share
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
    scan, projections = mixer_flops(model, local_tokens, sp, recompute_layers)
    return {
        "dense_s": (dense_flops + projections) / (peak * device.dense_efficiency),
        "attention_s": attn_flops / (peak * eff),
        "mixer_s": scan / (peak * device.attention_efficiency),
        "overhead_s": device.layer_overhead_s * L,
        "ring_step_flops": step_flops,
        "hw_flops": dense_flops + attn_flops + scan + projections,
    }


def mixer_flops(
    model: ModelSpec, local_tokens: float, sp_degree: int, recompute_layers: float = 0.0
) -> tuple[float, float]:
    """A hybrid model's mixer layers on one rank per micro step, hardware FLOPs (:mod:`usp.plan.mixers`):
    ``(scan, projections)``. ``scan``: the convolution and the chunked scan, forward, backward
    (:data:`usp.plan.mixers.MIXER_BWD_OVER_FWD` forwards) and the recompute of the checkpointed mixer layers
    (the same share of ``recompute_layers`` as of the layers), for the busiest rank's heads (the heads
    scheme) or the whole sequence (the gather); costed at the attention kernels' efficiency, an assumption
    until a GPU measures it. ``projections``: under the gather the mixer's projections run on all ``S``
    tokens, ``P - 1`` times the local work counted in the dense FLOPs; 0 for the heads scheme. (0, 0) when
    not hybrid."""
    m = model.mixer
    if m is None:
        return 0.0, 0.0
    gather = m.scheme(sp_degree) == "gather"
    share = sp_degree if gather else m.head_share(sp_degree)
    recomputed = recompute_layers * m.num_layers / model.num_layers
    forward = m.scan_flops_per_token() * local_tokens * share
    scan = forward * (m.num_layers * (1 + MIXER_BWD_OVER_FWD) + recomputed)
    extra = 2.0 * m.matmul_params(model.hidden_size) * local_tokens * (sp_degree - 1) if gather else 0.0
    return scan, extra * (3 * m.num_layers + recomputed)

"""The hybrid mixers' calls into the fast CUDA kernels, checked against those kernels' input contracts.

On CUDA, transformers binds a family's ``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule`` and
``mamba2_chunk_scan`` to causal-conv1d, flash-linear-attention and mamba-ssm where they are installed, and
usp's head all-to-all calls them per document (:mod:`usp.model.gated_deltanet`, :mod:`usp.model.mamba2`). No
GPU here, and fake CUDA tensors cannot run the mixers' code (a CPU build's device guard aborts on their
views), so the checks run the wrappers on CPU tensors with the real models' per-rank shapes and replace each
kernel by a stub that enforces what the library checks and the CPU path does not, then runs transformers'
torch code (forward and backward). The rules are read from the libraries' sources:

- causal-conv1d (``csrc/causal_conv1d.cpp``, ``causal_conv1d_fwd``; commit 0d2252d): float, half or bf16
  input and weight, the bias in the weight's dtype, ``x`` ``[B, C, L]``, weight ``[C, K]`` with ``2 <= K <=
  4``; ``x`` channel-first (``stride(2) == 1``) or channel-last (``stride(1) == 1``), any other layout is
  copied by its Python wrapper; channel-last needs ``C``, ``stride(0)`` and ``stride(2)`` to be multiples of 8,
  and the kernel raises otherwise;
- flash-linear-attention (``fla/ops/gated_delta_rule/chunk.py``, ``chunk_gated_delta_rule``; commit bc3b101):
  q and k ``[B, T, H, K]`` with the same heads, v ``[B, T, HV, V]`` with ``HV % H == 0``, g and beta ``[B, T,
  HV]``, ``K <= 256`` (``fla/ops/common/chunk_delta_h.py``);
- mamba-ssm (``mamba_ssm/ops/triton/ssd_combined.py``, ``_mamba_chunk_scan_combined_fwd``; commit e9594ce):
  x ``[B, L, H, P]``, dt ``[B, L, H]``, A ``[H]``, B and C ``[B, L, G, N]`` with ``H % G == 0``, D ``[H]`` or
  ``[H, P]``, dt_bias ``[H]``.

And for all three, every keyword usp passes is a parameter of the library's function: transformers' hub
wrapper keeps only those (``use_kernel_func_from_hub_with_fallback``), so a misspelled or missing one would
be dropped without a word (``use_qk_l2norm_in_kernel`` lost is a wrong model, not an error).
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.fake_cuda import ContractError
from usp.model import gated_deltanet, mamba2
from usp.model.conv_layout import conv_input

CONV_PARAMS = (
    "x",
    "weight",
    "bias",
    "seq_idx",
    "initial_states",
    "return_final_states",
    "final_states_out",
    "activation",
)
FLA_PARAMS = (
    "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
    "chunk_indices", "cp_context",
)  # fmt: skip
MAMBA_PARAMS = (
    "x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias", "initial_states", "seq_idx", "cu_seqlens",
    "dt_softplus", "dt_limit", "return_final_states", "return_varlen_states", "state_dtype",
)  # fmt: skip
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ContractError(msg)


def _keywords(kwargs: dict, params: tuple[str, ...], name: str) -> None:
    unknown = sorted(set(kwargs) - set(params))
    _require(not unknown, f"{name}: {unknown} are not its parameters; transformers' hub wrapper drops them")


def check_conv(x, weight, bias=None, **kwargs) -> None:
    """causal-conv1d's ``causal_conv1d_fn`` (module docstring)."""
    _keywords({"x": x, "weight": weight, "bias": bias, **kwargs}, CONV_PARAMS, "causal_conv1d_fn")
    _require(kwargs.get("activation") in (None, "silu", "swish"), "activation must be None, silu or swish")
    _require(x.dtype in FLOATS and weight.dtype in FLOATS, f"dtypes {x.dtype}, {weight.dtype}")
    _require(x.dim() == 3, f"x must be [B, C, L], got {tuple(x.shape)}")
    channels, width = x.size(1), weight.size(-1)
    _require(tuple(weight.shape) == (channels, width), f"weight {tuple(weight.shape)} is not ({channels}, K)")
    _require(2 <= width <= 4, f"width {width}: causal_conv1d only supports width between 2 and 4")
    if bias is not None:
        _require(bias.dtype == weight.dtype and tuple(bias.shape) == (channels,), "bias: weight's dtype, [C]")
    if x.stride(2) != 1 and x.stride(1) != 1:
        x = x.contiguous()  # its Python wrapper's copy
    if x.stride(1) == 1 and x.stride(2) > 1:
        _require(channels % 8 == 0, f"channel-last input needs C % 8 == 0, got C = {channels}")
        _require(
            x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0,
            f"channel-last input needs stride(0) and stride(2) multiples of 8, got {x.stride()}",
        )


def check_gated_delta_rule(q, k, v, g, beta, **kwargs) -> None:
    """flash-linear-attention's ``chunk_gated_delta_rule`` (module docstring)."""
    _keywords({"q": q, "k": k, "v": v, "g": g, "beta": beta, **kwargs}, FLA_PARAMS, "chunk_gated_delta_rule")
    b, t, h, dk = q.shape
    _require(tuple(k.shape) == (b, t, h, dk), f"k {tuple(k.shape)} is not q's {tuple(q.shape)}")
    _require(v.dim() == 4 and v.shape[:2] == q.shape[:2], f"v {tuple(v.shape)}")
    hv = v.size(2)
    _require(hv % h == 0, f"num_v_heads {hv} is not a multiple of num_heads {h}")
    _require(tuple(g.shape) == (b, t, hv) and tuple(beta.shape) == (b, t, hv), "g, beta must be [B, T, HV]")
    _require(dk <= 256, f"head dim {dk} > 256")


def check_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, **kwargs) -> None:
    """mamba-ssm's ``mamba_chunk_scan_combined`` (module docstring)."""
    named = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "chunk_size": chunk_size, "D": D, "z": z}
    _keywords({**named, "dt_bias": dt_bias, **kwargs}, MAMBA_PARAMS, "mamba_chunk_scan_combined")
    batch, seqlen, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    _require(heads % groups == 0, f"heads {heads} not a multiple of groups {groups}")
    _require(tuple(B.shape) == (batch, seqlen, groups, state) and C.shape == B.shape, "B, C [B, L, G, N]")
    _require(tuple(dt.shape) == (batch, seqlen, heads), f"dt {tuple(dt.shape)}")
    _require(tuple(A.shape) == (heads,), f"A {tuple(A.shape)}")
    _require(D is None or tuple(D.shape) in ((heads,), (heads, head_dim)), f"D {tuple(D.shape)}")
    _require(z is None or z.shape == x.shape, "z must be x's shape")
    _require(dt_bias is None or tuple(dt_bias.shape) == (heads,), f"dt_bias {tuple(dt_bias.shape)}")


def _stub(family, name: str, check, monkeypatch, calls: list) -> None:
    """Replace ``family.name`` by ``check`` then the original; each checked call's name goes to ``calls``."""
    original = getattr(family, name)

    def stub(*args, **kwargs):
        check(*args, **kwargs)
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(family, name, stub)


def _module(cls, config, **floats):
    """One mixer at the real model's size, on the CPU without an init (uninitialized weights, fast); the few
    parameters the kernels read set to ``floats``."""
    with torch.device("meta"):
        module = cls(config, 0)
    module = module.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, value in floats.items():
            getattr(module, name).fill_(value)
    return module


def _run(document, rows: torch.Tensor) -> None:
    rows.requires_grad_(True)
    out = document(rows)
    out.float().square().mean().backward()
    assert rows.grad is not None and torch.isfinite(rows.grad).all()


@pytest.mark.parametrize("sp_degree", [8, 12, 16])
def test_gated_deltanet_calls_meet_the_kernel_contracts(monkeypatch, sp_degree):
    """Qwen3-Next-80B's DeltaNet (16 key / 32 value heads of 128) on one rank of ``sp_degree`` (12: the
    uneven split, 2 or 1 key heads), one 70-token document (not a multiple of the 64-token chunk), bf16."""
    import transformers.models.qwen3_next.modeling_qwen3_next as family
    from transformers import AutoConfig

    from usp.plan.models import PRESETS

    calls: list[str] = []
    _stub(family, "causal_conv1d_fn", check_conv, monkeypatch, calls)
    _stub(family, "torch_chunk_gated_delta_rule", check_gated_delta_rule, monkeypatch, calls)
    config = AutoConfig.for_model(**PRESETS["qwen3-next-80b-a3b"])
    module = _module(family.Qwen3NextGatedDeltaNet, config, A_log=0.0, dt_bias=0.0)
    with torch.no_grad():
        module.norm.weight.fill_(1.0)
    hk = gated_deltanet.head_counts(module.num_k_heads, sp_degree)[-1]  # the last rank: fewest heads
    r, dk, dv = module.num_v_heads // module.num_k_heads, module.head_k_dim, module.head_v_dim
    weight = module.conv1d.weight.squeeze(1).index_select(0, gated_deltanet._channels(module, 0, hk, "cpu"))
    torch.nn.init.normal_(weight, std=0.1)
    rows = torch.randn(1, 70, hk, 2 * dk + 2 * r * dv + 2 * r, dtype=torch.bfloat16) * 0.1
    _run(lambda t: gated_deltanet._document(module, t, 0, weight, None), rows)
    assert set(calls) == {"causal_conv1d_fn", "torch_chunk_gated_delta_rule"}


@pytest.mark.parametrize(
    ("heads", "groups", "sp_degree"),
    [(128, 1, 8), (128, 1, 32), (128, 8, 4), (128, 8, 16)],
)
def test_mamba2_calls_meet_the_kernel_contracts(monkeypatch, heads, groups, sp_degree):
    """Bamba-9B's Mamba2 (128 heads of 64, state 128; and with 8 groups, as Nemotron-H's) on one rank of
    ``sp_degree``: its rows carry ``H / P`` dt values after the ``x``, ``B``, ``C`` channels, so at P = 32 the
    rows are 516 wide and the channel-last view breaks causal-conv1d's rule (``conv_input`` copies it); a
    document from inside a longer row, as the per-document loop slices it."""
    import transformers.models.bamba.modeling_bamba as family
    from transformers import AutoConfig

    from usp.plan.models import PRESETS

    calls: list[str] = []
    _stub(family, "causal_conv1d_fn", check_conv, monkeypatch, calls)
    _stub(family, "mamba2_chunk_scan", check_chunk_scan, monkeypatch, calls)
    fields = dict(PRESETS["bamba-9b"], mamba_n_heads=heads, mamba_n_groups=groups)
    config = AutoConfig.for_model(**fields)
    module = _module(family.BambaMixer, config, A_log=0.0, D=1.0, dt_bias=0.0)
    rank = sp_degree - 1
    head_range, group_range = mamba2._rank_layout(module, rank, sp_degree)
    xbc, dt_index = mamba2._channels(module, head_range, group_range)
    weight = module.conv1d.weight.squeeze(1).index_select(0, xbc)
    torch.nn.init.normal_(weight, std=0.1)
    bias = torch.zeros(xbc.numel(), dtype=torch.bfloat16)
    width = xbc.numel() + dt_index.numel()
    row = torch.randn(1, 300, width, dtype=torch.bfloat16) * 0.1

    def document(t):
        return mamba2._document(module, t[:, 37:237], weight, bias, dt_index, len(group_range))

    _run(document, row)
    assert set(calls) == {"causal_conv1d_fn", "mamba2_chunk_scan"}


def test_the_contracts_catch_what_the_kernels_reject():
    """The stubs can fail: the channel-last view of a Mamba2 rank's rows at P = 32 (516 wide) is what
    causal-conv1d raises on, and ``conv_input`` gives it a layout the kernel takes; a keyword the library does
    not have, q and k with different heads, groups that do not divide the heads are refused."""
    rows = torch.zeros(1, 300, 516)
    view = rows[:, 37:237, :512].transpose(1, 2)
    with pytest.raises(ContractError, match="multiples of 8"):
        check_conv(view, torch.zeros(512, 4))
    check_conv(conv_input(view), torch.zeros(512, 4))
    assert conv_input(rows[:, :, :512].transpose(1, 2)).stride(2) == 1
    aligned = torch.zeros(1, 300, 520)[:, 40:240, :512].transpose(1, 2)
    assert conv_input(aligned) is aligned  # the channel-last view the kernel takes, no copy
    with pytest.raises(ContractError, match="not its parameters"):
        check_conv(view.contiguous(), torch.zeros(512, 4), act="silu")
    q, v, g = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 4, 16), torch.zeros(1, 8, 4)
    with pytest.raises(ContractError, match="not q's"):
        check_gated_delta_rule(q, torch.zeros(1, 8, 1, 16), v, g, g)
    with pytest.raises(ContractError, match="not its parameters"):
        check_gated_delta_rule(q, q, v, g, g, use_qk_l2norm=True)
    x, b = torch.zeros(1, 8, 6, 4), torch.zeros(1, 8, 4, 2)
    with pytest.raises(ContractError, match="groups"):
        check_chunk_scan(x, torch.zeros(1, 8, 6), torch.zeros(6), b, b, 8)
    assert sys.modules[mamba2.__name__] is mamba2

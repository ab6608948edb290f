"""What the trainer counts for its model FLOPs and attention balance: the matmul parameters of the real model
(:func:`count_matmul_params`, the ``N`` of :func:`usp.plan.compute.training_flops`, the one model-FLOP count),
with LoRA the adapters' and the trainable ones (:func:`count_lora_matmul_params`), and the attention work
balance over the ring ranks (:func:`attention_work_imbalance`).

MFU from these: :func:`usp.plan.compute.mfu` over :func:`usp.train.peak_flops.peak_flops_per_device`.
"""

from __future__ import annotations

from typing import Any


def attention_work_imbalance(document_lengths: list[list[int]], ring_degree: int, ring_layout: str) -> float:
    """``attn_work_imbalance`` of a step: max / mean over ring ranks of the causal in-document (query, key) pairs
    each computes, summed over the step's samples (per sample, its packed document lengths).

    Exact pair counts from the layout (:func:`usp.parallel.ring_rank_pairs`); 1.0 = every ring rank does the
    same attention work. The slowest rank sets the step time, so ``1 / imbalance`` is the attention time a
    perfectly balanced layout would need.
    """
    import numpy as np

    from usp.parallel import ring_rank_pairs

    if ring_degree == 1:
        return 1.0
    work = np.zeros(ring_degree)
    for lengths in document_lengths:
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        work += np.asarray(ring_rank_pairs(int(cu[-1]), ring_degree, ring_layout, cu), dtype=np.float64)
    mean = work.mean()
    return float(work.max() / mean) if mean > 0 else 1.0


def count_matmul_params(model: Any) -> int:
    """Weights of every ``nn.Linear`` of ``model`` (global numel, also under FSDP2): the projections, the MLP
    and the LM head, tied to the input embedding or not. Not the embedding table (a lookup), the norm weights
    or biases (elementwise). For a Llama this is :attr:`usp.plan.models.ModelSpec.matmul_params`.

    Mixture-of-experts layers (transformers 5 stores a layer's experts as 3D ``[E, ., .]`` parameters and its
    router as a plain ``[E, H]`` weight): the weights a token multiplies, ``top_k / E`` of every expert tensor
    and the whole router, as the planner's ``matmul_params`` counts them (the FLOPs and MFU of active
    parameters)."""
    from torch import nn

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
            continue
        experts = getattr(module, "num_experts", None)
        if not top_k or not isinstance(experts, int) or isinstance(module, nn.Linear):
            continue
        for param in module.parameters(recurse=False):
            if id(param) in seen or param.dim() < 2 or param.shape[0] != experts:
                continue
            seen.add(id(param))
            if param.dim() == 3:  # [E, out, in]: each token uses top_k of the E experts
                total += param.numel() * top_k // experts
            elif param.dim() == 2 and hasattr(module, "top_k"):  # the router's [E, H] weight
                total += param.numel()
    return int(total)


def count_lora_matmul_params(model: Any, spec: Any) -> tuple[int, int]:
    """``(adapter_params, trainable_matmul_params)`` of the LoRA adapters ``spec``
    (:class:`usp.model.lora.LoraSpec`, target modules resolved or not) on ``model`` before they are injected
    (the plain model, on the meta device or not; nothing is changed).

    ``adapter_params``: ``r (in + out)`` for every ``nn.Linear`` of the decoder blocks that
    :func:`usp.model.lora.apply_lora` adapts (the one ``A [r, in]``, ``B [out, r]`` pair each): matmul weights
    every token runs, to add to :func:`count_matmul_params` for the model's ``N``. ``trainable_matmul_params``
    (the ``trainable_matmul_params`` of :func:`usp.plan.compute.training_flops`): the adapters, plus the matmul
    weights that train with ``train_embeddings_and_norms`` (an LM head tied to the trained input embedding; the
    embedding itself is a lookup). Like the planner (:mod:`usp.plan.lora`) it counts the adapters of linear
    layers only, not those ``peft`` may put on a MoE's stacked expert parameters."""
    from torch import nn

    from usp.model.lora import default_target_modules, embeddings_and_norms

    targets = set(spec.target_modules or default_target_modules(model))
    adapters = 0
    for name, module in model.named_modules():
        in_decoder = ".layers." in f".{name}" and "lora_" not in name
        if isinstance(module, nn.Linear) and in_decoder and name.rsplit(".", 1)[-1] in targets:
            adapters += spec.rank * (module.in_features + module.out_features)
    trained = 0
    if spec.train_embeddings_and_norms:
        modules = dict(model.named_modules())
        ids = {id(p) for name in embeddings_and_norms(model) for p in modules[name].parameters(recurse=False)}
        seen: set[int] = set()
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, nn.Linear) and id(weight) in ids and id(weight) not in seen:
                seen.add(id(weight))
                trained += weight.numel()
    return int(adapters), int(adapters + trained)

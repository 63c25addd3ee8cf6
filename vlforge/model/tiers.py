"""The trainable plan: which modules train, in which tier, with what rank, alpha, dropout and lr.

Three tiers over transformers' Qwen3-VL module tree:

    language   model.language_model.layers.N.self_attn.{q,k,v,o}_proj   (+ mlp.{gate,up,down}_proj)
               MoE: + mlp.experts.{gate_up_proj,down_proj} (experts: true), mlp.gate (router: true)
    projector  model.visual.merger.linear_fc{1,2}, model.visual.deepstack_merger_list.N.linear_fc{1,2}
    vision     model.visual.blocks.N.attn.{qkv,proj} for the last N blocks   (+ mlp.linear_fc{1,2})

With `tiers.method: lora` each selected Linear gets a LoRA adapter (peft) with its tier's r/alpha/
dropout; with `full` the tier's whole sub-tree trains (language includes embeddings and lm_head,
vision includes the patch embedding when every block trains). Everything else is frozen.
The plan is computed from module names and shapes only, so it works on a meta-device model.

Mixture-of-experts models (Qwen3-VL-30B-A3B, 235B-A22B) store each layer's experts as two fused
3-D parameters, not as nn.Linear per expert. `tiers.language.experts: true` gives each of them a
LoRA through peft's parameter targeting (`LoraConfig(target_parameters=...)`: one rank-r pair per
expert). With `tiers.expert_lora: fused` (the default) the experts apply it as activations in their
own grouped GEMM (model/moe_lora.py), with the tier's dropout; with `peft`, peft's forward folds it
into a copy of the weight, where dropout cannot apply (x cannot be factored out of the folded
weight), so those entries have dropout 0. The router (`mlp.gate`, [E, H])
is frozen unless `tiers.language.router: true`, and then trained fully, not through LoRA: it is tiny
(E x H, 0.26M values per 30B-A3B layer, less than an r=8 LoRA pair on an attention projection
saves), and a low-rank change of it shifts every token's expert choice at once, which is how
routing collapses; frozen routing keeps the pretrained load balance. Full fine-tuning trains every
language weight, experts included, and the router only with `router: true`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from torch import nn

from vlforge.config import ConfigError, TierConfig, TiersConfig

TIERS = ("language", "projector", "vision")
LORA_ADAPTER = "default"


@dataclass(frozen=True)
class PlanEntry:
    module: str
    tier: str
    kind: str  # "lora" | "full"
    r: int | None
    alpha: float | None
    dropout: float | None
    lr: float
    params: int  # trainable parameters this entry adds (LoRA) or unfreezes (full)
    target: str = "module"  # "module" (an nn.Linear / sub-tree) | "parameter" (a fused 3-D expert weight)
    expert_lora: str | None = None  # target "parameter": "fused" (moe_lora.py) | "peft" (ParamWrapper's fold)

    @property
    def owner(self) -> str:
        """The module holding the trained weights: the entry itself, or a parameter's module."""
        return self.module.rpartition(".")[0] if self.target == "parameter" else self.module


def expert_shape(param) -> tuple[int, int, int]:
    """(experts, in_features, out_features) of a fused expert weight [E, out, in] (transformers'
    layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]), as peft's ParamWrapper reads it."""
    experts, out_features, in_features = param.shape
    return experts, in_features, out_features


def is_moe_model(model: nn.Module) -> bool:
    return getattr(model.config, "model_type", None) == "qwen3_vl_moe"


def _expert_params(model: nn.Module) -> list[str]:
    names = []
    pattern = re.compile(r"model\.language_model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")
    for name, p in model.named_parameters():
        if pattern.fullmatch(name) and p.ndim == 3:
            names.append(name)
    return names


def _routers(model: nn.Module) -> list[str]:
    lm = model.model.language_model
    return [f"model.language_model.layers.{i}.mlp.gate" for i, layer in enumerate(lm.layers)
            if hasattr(layer.mlp, "experts")]


def _vision_blocks(model: nn.Module, tcfg: TierConfig) -> set[int]:
    depth = len(model.model.visual.blocks)
    n = depth if tcfg.last_n_blocks is None else min(tcfg.last_n_blocks, depth)
    return set(range(depth - n, depth))


def _lora_targets(model: nn.Module, tier: str, tcfg: TierConfig) -> list[str]:
    if tier == "language":
        leaf = r"self_attn\.[qkvo]_proj" + (r"|mlp\.(gate|up|down)_proj" if tcfg.mlp else "")
        pattern = re.compile(rf"model\.language_model\.layers\.\d+\.({leaf})")
    elif tier == "projector":
        pattern = re.compile(r"model\.visual\.(merger|deepstack_merger_list\.\d+)\.linear_fc[12]")
    else:
        blocks = _vision_blocks(model, tcfg)
        leaf = r"attn\.(qkv|proj)" + (r"|mlp\.linear_fc[12]" if tcfg.mlp else "")
        pattern = re.compile(rf"model\.visual\.blocks\.(\d+)\.({leaf})")
    names = []
    for name, module in model.named_modules():
        m = pattern.fullmatch(name)
        if m and isinstance(module, nn.Linear) and (tier != "vision" or int(m.group(1)) in blocks):
            names.append(name)
    return names


def _full_groups(model: nn.Module, tier: str, tcfg: TierConfig) -> list[str]:
    """Sub-module names whose parameters all train together in full fine-tuning."""
    if tier == "language":
        lm = model.model.language_model
        layers = []
        for i, layer in enumerate(lm.layers):
            prefix = f"model.language_model.layers.{i}"
            if hasattr(layer.mlp, "experts") and not tcfg.router:  # every child but the frozen router
                layers += [f"{prefix}.{child}" for child, _ in layer.named_children() if child != "mlp"]
                layers += [f"{prefix}.mlp.{child}" for child, _ in layer.mlp.named_children() if child != "gate"]
            else:
                layers.append(prefix)
        return ["model.language_model.embed_tokens"] + layers + ["model.language_model.norm", "lm_head"]
    if tier == "projector":
        n = len(model.model.visual.deepstack_merger_list)
        return ["model.visual.merger"] + [f"model.visual.deepstack_merger_list.{i}" for i in range(n)]
    blocks = sorted(_vision_blocks(model, tcfg))
    groups = [f"model.visual.blocks.{i}" for i in blocks]
    if len(blocks) == len(model.model.visual.blocks):
        groups = ["model.visual.patch_embed", "model.visual.pos_embed"] + groups
    return groups


def build_plan(model: nn.Module, tiers: TiersConfig) -> list[PlanEntry]:
    """Every trained module with its tier and hyper-parameters. `model` is the unwrapped HF model."""
    entries: list[PlanEntry] = []
    seen: set[int] = set()  # tied weights (2B/4B lm_head == embed_tokens) count once
    _check_moe_keys(model, tiers)
    for tier in TIERS:
        tcfg: TierConfig = getattr(tiers, tier)
        if not tcfg.train:
            continue
        if tiers.method == "lora":
            for name in _lora_targets(model, tier, tcfg):
                lin = model.get_submodule(name)
                params = tcfg.r * (lin.in_features + lin.out_features)
                entries.append(PlanEntry(name, tier, "lora", tcfg.r, tcfg.alpha, tcfg.dropout, tcfg.lr, params))
            if tier == "language" and tcfg.experts:
                fused = tiers.expert_lora == "fused"
                for name in _expert_params(model):
                    experts, fan_in, fan_out = expert_shape(model.get_parameter(name))
                    # peft's own forward has no dropout there (see the module docstring)
                    entries.append(PlanEntry(name, tier, "lora", tcfg.r, tcfg.alpha, tcfg.dropout if fused else 0.0,
                                             tcfg.lr, tcfg.r * experts * (fan_in + fan_out), target="parameter",
                                             expert_lora=tiers.expert_lora))
            if tier == "language" and tcfg.router:
                for name in _routers(model):
                    params = model.get_submodule(name).weight.numel()
                    entries.append(PlanEntry(name, tier, "full", None, None, None, tcfg.lr, params))
        else:
            for name in _full_groups(model, tier, tcfg):
                params = 0
                for p in model.get_submodule(name).parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params += p.numel()
                entries.append(PlanEntry(name, tier, "full", None, None, None, tcfg.lr, params))
    if not entries:
        raise ConfigError("the plan trains nothing: set train: true on at least one of tiers.language/projector/vision")
    return entries


def _check_moe_keys(model: nn.Module, tiers: TiersConfig) -> None:
    lang = tiers.language
    if (lang.experts or lang.router) and not is_moe_model(model):
        key = "experts" if lang.experts else "router"
        raise ConfigError(f"tiers.language.{key}: this model is dense (no mixture-of-experts layers); "
                          "use a Qwen3-VL MoE model (model.preset=tiny-moe / qwen3vl-30b-a3b, or a 30B-A3B "
                          f"directory) or set tiers.language.{key}=false")


def plan_summary(model: nn.Module, plan: list[PlanEntry]) -> dict:
    """Parameter counts of a plan, the same before and after it is applied: with LoRA the total is
    the base's parameters plus the adapters', whether or not `model` holds the adapters yet."""
    trainable = sum(e.params for e in plan)
    # tied weights once; a router trained beside LoRA is a peft copy (modules_to_save) counted once
    base = sum(p.numel() for name, p in model.named_parameters()
               if ".lora_" not in name and ".modules_to_save." not in name)
    total = base + sum(e.params for e in plan if e.kind == "lora")
    return {"modules": [asdict(e) for e in plan], "trainable_params": trainable, "total_params": total,
            "trainable_fraction": trainable / total}


def format_plan(summary: dict) -> str:
    rows = [("module", "tier", "kind", "r", "alpha", "dropout", "lr", "params")]
    for e in summary["modules"]:
        kind = e["kind"] + (f" (3-D experts, {e.get('expert_lora')})" if e.get("target") == "parameter" else "")
        rows.append((e["module"], e["tier"], kind, str(e["r"] or "-"), str(e["alpha"] or "-"),
                     "-" if e["dropout"] is None else str(e["dropout"]), f"{e['lr']:g}", f"{e['params']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"trainable {summary['trainable_params']:,} / total {summary['total_params']:,} parameters "
                 f"({100 * summary['trainable_fraction']:.3f}%)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- applying


def apply_plan(model: nn.Module, plan: list[PlanEntry]) -> nn.Module:
    """Freeze everything, then add LoRA adapters (returns a peft model) or unfreeze the full groups.

    A LoRA plan's full entries (a trained MoE router) become peft `modules_to_save`: a trained copy
    that the adapter checkpoint saves, `merge_and_unload` puts in place and `disable_adapter`
    (GRPO's reference) sets aside."""
    model.requires_grad_(False)
    lora = [e for e in plan if e.kind == "lora"]
    if not lora:
        for e in plan:
            model.get_submodule(e.module).requires_grad_(True)
        return model

    from peft import LoraConfig, get_peft_model

    modules = [e for e in lora if e.target == "module"]
    params = [e for e in lora if e.target == "parameter"]
    full = [e.module for e in plan if e.kind == "full"]
    config = LoraConfig(
        target_modules=[e.module for e in modules],
        target_parameters=[e.module for e in params] or None,
        modules_to_save=full or None,
        r=lora[0].r, lora_alpha=lora[0].alpha, lora_dropout=0.0, bias="none",
        # expert entries are the language tier's, lora[0]'s when they exist: the defaults above
        rank_pattern={re.escape(e.module): e.r for e in modules},
        alpha_pattern={re.escape(e.module): e.alpha for e in modules},
    )
    peft_model = get_peft_model(model, config)
    # peft has one dropout per config; tiers each have their own, so set it per module.
    for e in modules:
        layer = model.get_submodule(e.module)
        layer.lora_dropout[LORA_ADAPTER] = nn.Dropout(e.dropout) if e.dropout else nn.Identity()
    fused = [e for e in params if e.expert_lora == "fused"]
    if fused:
        from vlforge.model.moe_lora import expert_wrapper, fuse_expert_lora

        for e in fused:  # peft's ParamWrapper refuses a config dropout; the fused forward applies this one
            layer = expert_wrapper(model.get_submodule(e.owner), e.module.rpartition(".")[2])
            layer.lora_dropout[LORA_ADAPTER] = nn.Dropout(e.dropout) if e.dropout else nn.Identity()
        fuse_expert_lora(model)
    return peft_model


def canonical_name(name: str) -> str:
    """A module name as in the plain HF model: peft's `base_model.model.` prefix and the
    `.base_layer` of a LoRA-wrapped linear removed."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def unwrap(model: nn.Module) -> nn.Module:
    """The Qwen3VLForConditionalGeneration inside a peft wrapper (LoRA layers are injected in place)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def fsdp_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (fully_shard) wraps any module of `model`: its parameters are DTensor shards,
    gathered by hooks around each unit's forward (even on one process)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def tier_of_param(name: str, plan: list[PlanEntry]) -> str | None:
    """Tier of a trainable parameter name (peft prefixes like base_model.model. are tolerated;
    an expert LoRA's A/B live on the experts module, `.base_layer` nested once per parameter)."""
    plain = canonical_name(name)
    for e in plan:
        if f"{e.module}." in name or name.endswith(e.module) or plain.startswith(f"{e.owner}."):
            return e.tier
    return None


def param_groups(model: nn.Module, plan: list[PlanEntry], weight_decay: float) -> list[dict]:
    """AdamW groups, one per (tier, decay/no-decay). Biases, norms and LoRA-free 1-D params get no decay."""
    groups: dict[tuple[str, bool], dict] = {}
    lrs = {e.tier: e.lr for e in plan}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        tier = tier_of_param(name, plan)
        if tier is None:
            raise RuntimeError(f"trainable parameter {name} is not in the plan")
        decay = p.ndim >= 2 and weight_decay > 0
        g = groups.setdefault((tier, decay), {"params": [], "lr": lrs[tier], "tier": tier,
                                              "weight_decay": weight_decay if decay else 0.0})
        g["params"].append(p)
    return list(groups.values())

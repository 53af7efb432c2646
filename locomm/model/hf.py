"""A checkpoint's weights as one unsplit model: written as a Hugging Face Llama folder, or sampled from.

Notable:
- :func:`load_weights` reads a data-parallel node's checkpoint or every stage checkpoint of a pipeline
  replica and gives one :class:`ModelWeights` in :class:`~locomm.model.llama.LlamaModel`'s names. "outer"
  weights are the outer algorithm's phi (``aux/phi/...``, the last outer point every peer agreed on);
  "local" weights are the replica's fast weights (``model/...``). By default phi when the checkpoint
  holds it, else the model (``locomm-peer train`` has no outer algorithm).
- The run spec comes from the checkpoint (``extra["spec_toml"]``, checked against its hash), else from
  the caller's (``--config``/``--preset``), which must have the checkpoint's hash.
- Pipeline stages are put back together by parameter name (a stage's names are the full model's). The
  subspace form is exact as plain Llama when ``branch_norm`` is off: stage 0's ``E_learn + E_f`` is one
  embedding, and the boundary map ``h = U U^T (h - E_f) + E_f`` is the identity while every write before
  the last boundary lies in span(U), which is checked (and ``subspace_form`` "reparam" keeps the same
  forward weights). ``branch_norm`` (an RMSNorm on each branch output) has no Llama equivalent: the
  export refuses it. :func:`build_model_from` (generate, eval) runs the stages themselves, so it takes any.
- Rotary: locomm rotates pairs ``(2i, 2i+1)`` of each head; Hugging Face's Llama rotates ``(i, i + Dh/2)``
  (``rotate_half``) with the same frequency ``theta^(-2i/Dh)``. Permuting the rows of each head of wq and
  wk (even rows first, then odd) turns one into the other; q.k is unchanged because both move alike.
- No ``transformers`` import: the folder is safetensors and JSON. The byte tokenizer (id = byte value,
  then BOS, EOS, PAD = 256, 257, 258; the rest of the vocabulary is padding never trained) is written as a
  ``tokenizers`` byte-level BPE with no merges, so ``AutoTokenizer`` loads it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from locomm.checkpoint import (
    CHECKPOINT_NAME,
    Checkpoint,
    CheckpointError,
    atomic_write_text,
    checkpoint_spec,
    load_checkpoint,
    load_model_tensors,
    save_tensors_atomic,
)
from locomm.config import ModelConfig, RunSpec
from locomm.model.llama import LlamaModel
from locomm.model.stages import ConstrainedModel, Geometry, build_stages

WEIGHTS = ("outer", "local")
BOS, EOS, PAD = 256, 257, 258  # locomm.data.corpus's specials (model/ does not import data/)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SPAN_TOL = 1e-4
"""Largest relative norm outside span(U) of a write before the last boundary for the export to be exact."""


@dataclass
class ModelWeights:
    """One model's config (``tie_embeddings`` as the tensors are) and its tensors in locomm's names."""

    spec: RunSpec
    cfg: ModelConfig
    tensors: dict[str, torch.Tensor]
    source: str
    """What was read, in words: which weights, from which checkpoint(s), at which step/round."""
    geo: Geometry | None = None
    """A pipeline's geometry: ``tensors`` are then the stages' own (E_learn without E_f)."""

    def llama_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the plain Llama that computes this model; CheckpointError when none does exactly."""
        if self.geo is None or not (self.geo.subspace or self.geo.branch_norm):
            return self.tensors
        return _unconstrain(self.geo, self.tensors)


def find_checkpoints(dirs: Sequence[Path]) -> list[Path]:
    """Checkpoint files in ``dirs``: each one holds a checkpoint, or sub-folders that do (one level down)."""
    found: list[Path] = []
    for d in map(Path, dirs):
        if (d / CHECKPOINT_NAME).is_file():
            found.append(d / CHECKPOINT_NAME)
            continue
        if not d.is_dir():
            raise CheckpointError(f"--checkpoint-dir {d}: no such folder")
        inner = sorted(p / CHECKPOINT_NAME for p in d.iterdir() if (p / CHECKPOINT_NAME).is_file())
        if not inner:
            raise CheckpointError(f"--checkpoint-dir {d}: no {CHECKPOINT_NAME} in it or in its sub-folders")
        found.extend(inner)
    if len(set(p.resolve() for p in found)) != len(found):
        raise CheckpointError("the same checkpoint was given twice")
    return found


def _pick(ckpt: Checkpoint, path: Path, weights: str | None) -> tuple[dict[str, torch.Tensor], str]:
    """The model's tensors from one checkpoint: phi (outer) or the local model, and which it was."""
    phi = {k[len("phi/") :]: v for k, v in ckpt.aux.items() if k.startswith("phi/")}
    if weights == "local" or (weights is None and not phi):
        return dict(ckpt.model), "local"
    if not phi:
        raise CheckpointError(f"{path}: no outer weights (phi) in it (no outer algorithm ran); use --weights local")
    missing = sorted(set(ckpt.model) - set(phi))
    if missing:
        raise CheckpointError(f"{path}: its outer state lacks {missing[:3]}; use --weights local")
    return {k: phi[k] for k in ckpt.model}, "outer"


def load_weights(dirs: Sequence[Path], *, weights: str | None = None, given: RunSpec | None = None) -> ModelWeights:
    """The unsplit model in ``dirs`` (one data-parallel checkpoint, or one checkpoint per pipeline stage).

    Args:
        weights: "outer" (phi), "local" (the replica's model), or None: phi when the checkpoint holds it.
        given: the run spec to fall back on when a checkpoint carries none (it must have its hash).

    Raises:
        CheckpointError: nothing readable there, specs disagree, a stage is missing or doubled, or the
            model cannot be written as a plain Llama.
    """
    if weights not in (None, *WEIGHTS):
        raise CheckpointError(f"--weights: expected one of {WEIGHTS}, got {weights!r}")
    paths = find_checkpoints(dirs)
    spec = checkpoint_spec(paths[0].parent, given)
    ckpts = [load_checkpoint(p) for p in paths]
    for p, c in zip(paths, ckpts, strict=True):
        if c.spec_hash != ckpts[0].spec_hash:
            raise CheckpointError(
                f"{p} and {paths[0]} come from different run specs (hash {c.spec_hash[:12]} vs "
                f"{ckpts[0].spec_hash[:12]}): not stages of one model"
            )
    stage_of = [c.extra.get("stage") for c in ckpts]
    if all(s is None for s in stage_of):
        if len(ckpts) > 1:
            raise CheckpointError(
                f"{len(ckpts)} data-parallel checkpoints given ({', '.join(map(str, paths))}); pass one"
            )
        tensors, kind = _pick(ckpts[0], paths[0], weights)
        where = f"round {ckpts[0].extra['round']}, " if "round" in ckpts[0].extra else ""
        return ModelWeights(spec, spec.model, tensors, f"{kind} weights of {paths[0]} ({where}step {ckpts[0].step})")
    if any(s is None for s in stage_of):
        raise CheckpointError("a data-parallel checkpoint was given with pipeline stage checkpoints")
    return _merge_stages(spec, paths, ckpts, weights)


def _merge_stages(spec: RunSpec, paths: list[Path], ckpts: list[Checkpoint], weights: str | None) -> ModelWeights:
    geo = Geometry.of(spec)
    by_stage: dict[int, Path] = {}
    tensors: dict[str, torch.Tensor] = {}
    kinds = set()
    for p, c in zip(paths, ckpts, strict=True):
        s = int(c.extra["stage"])
        if s in by_stage:
            raise CheckpointError(f"two checkpoints of stage {s} ({by_stage[s]}, {p}): pass one replica per stage")
        by_stage[s] = p
        part, kind = _pick(c, p, weights)
        kinds.add(kind)
        tensors.update(part)
    missing = [s for s in range(geo.stages) if s not in by_stage]
    if missing:
        raise CheckpointError(
            f"the run has {geo.stages} pipeline stages; no checkpoint of stage(s) {missing} was given "
            f"(got {sorted(by_stage)})"
        )
    if len(kinds) > 1:
        raise CheckpointError("some stages hold outer weights and some do not: pass --weights local")
    cfg = dataclasses.replace(spec.model, tie_embeddings=False)  # stages hold an untied head
    return ModelWeights(spec, cfg, tensors, f"{kinds.pop()} weights of {geo.stages} pipeline stages", geo)


def _unconstrain(geo: Geometry, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The subspace form as a plain Llama (exact), or CheckpointError saying why it is not one."""
    if geo.branch_norm:
        raise CheckpointError(
            "pipeline.branch_norm puts a gain-free RMSNorm on every attention and MLP output before the "
            "residual add; Hugging Face's Llama has no such norm, so this model cannot be written as one"
        )
    U = geo.U.double()
    writes = [f"layers.{i}.{m}.weight" for r in geo.ranges[:-1] for i in r for m in ("attn.wo", "mlp.w2")]
    for name in writes:
        w = tensors[name].double()  # (d, in): the columns must lie in span(U)
        off = float((w - U @ (U.T @ w)).norm() / w.norm().clamp_min(1e-30))
        if off > _SPAN_TOL:
            raise CheckpointError(f"{name} is not in the subspace (relative off-span norm {off:.1e}): not exact")
    out = dict(tensors)
    e = tensors["embed.weight"].double()
    if float((e - (e @ U) @ U.T).norm() / e.norm().clamp_min(1e-30)) > _SPAN_TOL:
        raise CheckpointError("embed.weight is not in the subspace: the boundary map is not the identity")
    out["embed.weight"] = (e + geo.E_f.double()).to(tensors["embed.weight"].dtype)  # h0 = E_learn[t] + E_f[t]
    return out


def build_model_from(w: ModelWeights, device: str | torch.device = "cpu") -> LlamaModel | ConstrainedModel:
    """locomm's own model holding ``w`` (eval mode): a pipeline's stages run back to back, with their
    boundary map, E_f and ``branch_norm`` (:class:`~locomm.model.stages.ConstrainedModel`), as the swarm
    computes it; else the :class:`~locomm.model.llama.LlamaModel`."""
    if w.geo is None:
        model = LlamaModel(w.cfg)
        load_model_tensors(model, w.tensors)
        return model.to(device).eval()
    stages = build_stages(w.spec, w.geo)
    for st in stages:
        own = set(st.state_dict())
        load_model_tensors(st, {k: v for k, v in w.tensors.items() if k in own})
    return ConstrainedModel(stages).to(device).eval()


def context_length(model: LlamaModel | ConstrainedModel) -> int:
    """The longest input ``model`` takes (its rotary table)."""
    return model.cfg.max_seq_len if isinstance(model, LlamaModel) else model.stages[0].max_seq_len


# -- Hugging Face ------------------------------------------------------------------------


def rotary_permutation(head_dim: int) -> torch.Tensor:
    """Row order within a head that turns interleaved pairs (2i, 2i+1) into halves (i, i + Dh/2)."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of ``LlamaForCausalLM`` for ``cfg`` (multi-head attention: as many kv heads as heads)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers < 5
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers >= 5
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }


def hf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """locomm's tensors in ``LlamaForCausalLM``'s names, wq/wk rows permuted to the rotate-half convention."""
    H, Dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    perm = rotary_permutation(Dh)

    def rope_rows(w: torch.Tensor) -> torch.Tensor:  # (H*Dh, d)
        return w.view(H, Dh, -1)[:, perm].reshape(H * Dh, -1)

    out = {"model.embed_tokens.weight": tensors["embed.weight"], "model.norm.weight": tensors["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = tensors["head.weight"]
    names = {
        "attn.wq": "self_attn.q_proj",
        "attn.wk": "self_attn.k_proj",
        "attn.wv": "self_attn.v_proj",
        "attn.wo": "self_attn.o_proj",
        "mlp.w1": "mlp.gate_proj",
        "mlp.w3": "mlp.up_proj",
        "mlp.w2": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
    }
    for i in range(cfg.n_layers):
        for ours, theirs in names.items():
            t = tensors[f"layers.{i}.{ours}.weight"]
            out[f"model.layers.{i}.{theirs}.weight"] = rope_rows(t) if ours in ("attn.wq", "attn.wk") else t
    return out


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (what the ``tokenizers`` ByteLevel pre-tokenizer maps byte b to)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tokenizer_json() -> dict:
    """``tokenizer.json``: token id = byte value (a byte-level BPE without merges), specials 256-258."""
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    specials = [("<bos>", BOS), ("<eos>", EOS), ("<pad>", PAD)]
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}
            for s, i in specials
        ],
        "normalizer": None,
        "pre_tokenizer": level,
        "post_processor": None,
        "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {**vocab, **{s: i for s, i in specials}}, "merges": []},
    }  # fmt: skip


def write_hf(out: Path, w: ModelWeights, dtype: str = "float32") -> list[Path]:
    """Write ``w`` to folder ``out`` as a Hugging Face Llama (atomically, file by file); returns the files."""
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(DTYPES[dtype]) for k, v in hf_tensors(w.cfg, w.llama_tensors()).items()}
    files = {
        "config.json": hf_config(w.cfg, dtype),
        "generation_config.json": {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD},
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "add_bos_token": False,
            "model_max_length": w.cfg.max_seq_len,
            "clean_up_tokenization_spaces": False,
        },
    }
    paths = [out / "model.safetensors"]
    save_tensors_atomic(paths[0], tensors, metadata={"format": "pt", "locomm_source": w.source})
    for name, obj in files.items():
        atomic_write_text(out / name, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        paths.append(out / name)
    mask = os.umask(0)
    os.umask(mask)
    for p in paths:  # atomic writes are private (0600); an export is meant to be shared, as a plain write
        p.chmod(0o666 & ~mask)
    return paths


# -- sampling ----------------------------------------------------------------------------


@torch.no_grad()
def sample(
    model: LlamaModel | ConstrainedModel,
    prompt: Sequence[int],
    *,
    max_new: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    stop: int | None = EOS,
) -> list[int]:
    """Continue ``prompt`` by up to ``max_new`` tokens (fewer when ``stop`` comes; it is not returned).

    Temperature 0 is greedy (argmax, as ``generate(do_sample=False)``); the context is cut to the last
    ``max_seq_len`` tokens. Without a KV cache: each token is one forward over the context.
    """
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError("temperature must be >= 0 and top_k >= 1")
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = context_length(model)
    ctx = list(prompt) or [EOS]  # an empty prompt starts a document, as after an EOS in training
    new: list[int] = []
    for _ in range(max_new):
        x = torch.tensor([ctx[-n:]], dtype=torch.long, device=device)
        logits = model(x)[0, -1].float().cpu()  # (V,)
        if temperature == 0:
            tok = int(logits.argmax())
        else:
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
        if tok == stop:
            break
        new.append(tok)
        ctx.append(tok)
    return new

#!/usr/bin/env python
"""Generate the golden fixtures under tests/golden/ (needs torch + transformers).

Run from the repository root:

    python tests/make_golden.py

For each tiny random ERNIE-4.5 MoE model this script

1. builds an HF ``Ernie4_5_MoeForCausalLM`` (fp32, eager attention), seeds torch, and fills every
   parameter with its own init. Every parameter is rounded to bf16 and back, so the bf16 Paddle
   files and the fp32 HF files hold exactly the same numbers;
2. writes ``<name>/hf/`` with ``save_pretrained`` and checks that a reload gives bit-identical
   logits;
3. writes ``<name>/paddle/`` in the official Paddle release layout (``ernie.`` prefix, [in, out]
   linears, fused qkv / up_gate, ``moe_statics``, Paddle config keys). This layout is produced by
   the independent numpy code below, with a small safetensors writer of its own, and NOT by any
   ernie_jax code. Storage differs on purpose between models (U16 / BF16 / F32 header dtypes,
   one file vs two shards plus an index, MTP in the main file or in ``mtp/``), so a loader has to
   be tolerant;
4. writes ``<name>/golden.npz`` with reference outputs from the HF torch model (see
   ``compute_goldens`` for the exact definitions);
5. re-reads the Paddle files with its own reader and runs an independent float64 numpy forward
   (interleaved RoPE, GQA, softmax routing with a selection-only bias, shared experts, MTP).
   That forward must reproduce the HF logits and routing and the torch MTP logits. This checks
   the Paddle layout end to end.

Everything is deterministic: same library versions give identical files.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import sys

import numpy as np
import torch

from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM
from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as hf_ernie

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")

SEQ_LEN = 11
BATCH = 2
PROMPT_LEN = 5
NEW_TOKENS = 12

# Init scales. Every value is rounded to bf16 after init. The scales are large on purpose: logits
# have std O(1), routing is decisive (router std 0.3), the correction bias (about the size of the
# softmax probabilities) changes a good share of the expert choices, and greedy decoding does not
# collapse into repeating one token.
STD_EMBED = 0.5
STD_LINEAR = 0.1  # default; each model spec overrides it with "std_linear" (see MODELS)
STD_LM_HEAD = 0.15  # untied only; the tied head is the std-0.5 embedding
STD_ROUTER = 0.3
STD_BIAS = 0.05
STD_NORM_GAIN = 0.2


# --------------------------------------------------------------------------------------------
# Model specs
# --------------------------------------------------------------------------------------------

MODELS = [
    dict(
        name="shared_untied",
        seed=1001,
        std_linear=0.15,
        hf=dict(
            vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
            moe_num_experts=8, moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=1,
            moe_layer_end_index=-1, moe_layer_interval=1, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        rope_theta=500000.0,
        head_dim=None,  # not in either config; hidden/heads = 16
        storage="single_u16",
        mtp="main",
    ),
    dict(
        name="noshared_tied",
        seed=2002,
        # the tied head plus a residual stream dominated by the std-0.5 embedding makes the model
        # predict its own input token (greedy output "51 51 51 ..." at 0.1); 0.2 gives varied output
        std_linear=0.2,
        hf=dict(
            vocab_size=200, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
            num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=24,
            moe_num_experts=6, moe_k=3, moe_num_shared_experts=0, moe_layer_start_index=1,
            moe_layer_end_index=-1, moe_layer_interval=1, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        rope_theta=10000.0,
        head_dim=None,  # 8
        storage="sharded_bf16",
        mtp=None,
    ),
    dict(
        name="interval2_headdim",
        seed=3003,
        std_linear=0.15,
        hf=dict(
            vocab_size=160, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, num_hidden_layers=5, intermediate_size=80, moe_intermediate_size=16,
            moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
            moe_layer_end_index=3, moe_layer_interval=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        rope_theta=500000.0,
        head_dim=32,  # explicit, != 64/4
        storage="single_bf16",
        mtp="subfolder",
    ),
]


def is_moe_layer(i: int, start: int, end: int, interval: int) -> bool:
    return (i + 1) % interval == 0 and start <= i <= end


# --------------------------------------------------------------------------------------------
# bf16 helpers (pure numpy, independent of ml_dtypes / torch)
# --------------------------------------------------------------------------------------------

def bf16_bits(a: np.ndarray) -> np.ndarray:
    """fp32 array that is exactly bf16-representable -> uint16 bf16 bit patterns."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    if np.any(u & 0xFFFF):
        raise ValueError("tensor is not exactly bf16-representable")
    return (u >> 16).astype(np.uint16)


def bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


# --------------------------------------------------------------------------------------------
# Minimal safetensors writer / reader (own code, so the header dtypes are fully controlled)
# --------------------------------------------------------------------------------------------

def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> int:
    """tensors: name -> (dtype_str, np.ndarray with matching itemsize). Returns data bytes."""
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        dt, arr = tensors[name]
        arr = np.ascontiguousarray(arr)
        assert {"F32": 4, "BF16": 2, "U16": 2}[dt] == arr.dtype.itemsize, (name, dt, arr.dtype)
        raw = arr.tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in blobs:
            f.write(raw)
    return offset


def read_safetensors(path: str) -> dict:
    """-> name -> (header dtype, fp32 numpy array)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        raw = data[base + s: base + e]
        dt = info["dtype"]
        if dt in ("U16", "BF16"):
            arr = bits_to_f32(np.frombuffer(raw, dtype="<u2"))
        elif dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4").copy()
        else:
            raise ValueError(dt)
        out[name] = (dt, arr.reshape(info["shape"]))
    return out


# --------------------------------------------------------------------------------------------
# Building the HF model
# --------------------------------------------------------------------------------------------

def round_bf16_(t: torch.Tensor) -> None:
    t.data = t.data.to(torch.bfloat16).to(torch.float32)


def init_param_(name: str, p: torch.Tensor, std_linear: float = STD_LINEAR) -> None:
    with torch.no_grad():
        if "embed_tokens" in name:
            p.normal_(0.0, STD_EMBED)
        elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.copy_(1.0 + STD_NORM_GAIN * torch.randn_like(p))
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, STD_ROUTER)
        elif name.endswith("e_score_correction_bias"):
            p.normal_(0.0, STD_BIAS)
        elif name == "lm_head.weight":
            p.normal_(0.0, STD_LM_HEAD)
        else:
            assert p.dim() >= 2, name
            p.normal_(0.0, std_linear)
    round_bf16_(p)


def build_hf_model(spec):
    cfg = Ernie4_5_MoeConfig(**spec["hf"], rms_norm_eps=1e-5)
    model = Ernie4_5_MoeForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    tied = spec["hf"]["tie_word_embeddings"]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    torch.manual_seed(spec["seed"])
    for name, p in model.named_parameters():  # a tied lm_head is not listed separately
        init_param_(name, p, spec["std_linear"])
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
    return model


class MTP(torch.nn.Module):
    """The MTP module (spec section 5), built from HF modules."""

    def __init__(self, main_cfg):
        super().__init__()
        cfg = copy.deepcopy(main_cfg)
        cfg.moe_layer_start_index = max(1, cfg.moe_layer_start_index)  # layer 0 dense
        H = cfg.hidden_size
        self.emb_norm = hf_ernie.Ernie4_5_MoeRMSNorm(H, cfg.rms_norm_eps)
        self.hid_norm = hf_ernie.Ernie4_5_MoeRMSNorm(H, cfg.rms_norm_eps)
        self.linear_proj = torch.nn.Linear(2 * H, H, bias=False)  # torch weight [H, 2H]
        self.block = hf_ernie.Ernie4_5_MoeDecoderLayer(cfg, layer_idx=0)
        assert isinstance(self.block.mlp, hf_ernie.Ernie4_5_MoeMLP)
        assert self.block.mlp.intermediate_size == cfg.intermediate_size

    def init_(self, std_linear: float):
        for name, p in self.named_parameters():
            if name in ("emb_norm.weight", "hid_norm.weight"):
                with torch.no_grad():
                    p.copy_(1.0 + STD_NORM_GAIN * torch.randn_like(p))
                round_bf16_(p)
            else:
                init_param_(name, p, std_linear)


# --------------------------------------------------------------------------------------------
# HF state dict -> Paddle layout (numpy)
# --------------------------------------------------------------------------------------------

def layer_to_paddle(sd: dict, src: str, dst: str, moe: bool, n_experts: int, has_shared: bool) -> dict:
    """sd: HF names -> fp32 numpy (torch orientation). Returns Paddle names -> fp32 numpy."""
    out = {}
    out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
    out[dst + "post_attention_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"]
    q = sd[src + "self_attn.q_proj.weight"]
    k = sd[src + "self_attn.k_proj.weight"]
    v = sd[src + "self_attn.v_proj.weight"]
    out[dst + "self_attn.qkv_proj.weight"] = np.concatenate([q.T, k.T, v.T], axis=1)
    out[dst + "self_attn.o_proj.weight"] = sd[src + "self_attn.o_proj.weight"].T
    if not moe:
        g = sd[src + "mlp.gate_proj.weight"]
        u = sd[src + "mlp.up_proj.weight"]
        out[dst + "mlp.up_gate_proj.weight"] = np.concatenate([g.T, u.T], axis=1)
        out[dst + "mlp.down_proj.weight"] = sd[src + "mlp.down_proj.weight"].T
        return out
    out[dst + "mlp.gate.weight"] = sd[src + "mlp.gate.weight"].T  # [H, E]
    out[dst + "mlp.moe_statics.e_score_correction_bias"] = sd[src + "mlp.gate.moe_statics.e_score_correction_bias"]
    gu = sd[src + "mlp.experts.gate_up_proj"]  # [E, 2I, H]; rows [gate | up]
    dn = sd[src + "mlp.experts.down_proj"]  # [E, H, I]
    assert gu.shape[0] == n_experts
    I = gu.shape[1] // 2
    for e in range(n_experts):
        gate_t, up_t = gu[e, :I], gu[e, I:]
        out[dst + f"mlp.experts.{e}.up_gate_proj.weight"] = np.concatenate([gate_t.T, up_t.T], axis=1)
        out[dst + f"mlp.experts.{e}.down_proj.weight"] = dn[e].T
    if has_shared:
        g = sd[src + "mlp.shared_experts.gate_proj.weight"]
        u = sd[src + "mlp.shared_experts.up_proj.weight"]
        out[dst + "mlp.shared_experts.up_gate_proj.weight"] = np.concatenate([g.T, u.T], axis=1)
        out[dst + "mlp.shared_experts.down_proj.weight"] = sd[src + "mlp.shared_experts.down_proj.weight"].T
    return out


def to_paddle(spec, model, mtp) -> tuple[dict, dict]:
    """-> (main Paddle tensors, MTP Paddle tensors); fp32 numpy values, Paddle orientation."""
    c = model.config
    sd = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    P = {"ernie.embed_tokens.weight": sd["model.embed_tokens.weight"], "ernie.norm.weight": sd["model.norm.weight"]}
    for i in range(c.num_hidden_layers):
        moe = is_moe_layer(i, c.moe_layer_start_index, c.moe_layer_end_index, c.moe_layer_interval)
        P.update(layer_to_paddle(sd, f"model.layers.{i}.", f"ernie.layers.{i}.", moe,
                                 c.moe_num_experts, c.moe_num_shared_experts > 0))
    if not c.tie_word_embeddings:
        P["lm_head.weight"] = sd["lm_head.weight"].T  # [H, V]
    M = {}
    if mtp is not None:
        msd = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in mtp.state_dict().items()}
        M["ernie.mtp_emb_norm.0.weight"] = msd["emb_norm.weight"]
        M["ernie.mtp_hidden_norm.0.weight"] = msd["hid_norm.weight"]
        M["ernie.mtp_linear_proj.0.weight"] = msd["linear_proj.weight"].T  # [2H, H]
        M.update(layer_to_paddle(msd, "block.", "ernie.mtp_block.0.", False, 0, False))
    return P, M


def paddle_config(spec, model) -> dict:
    c = model.config
    cfg = {
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "model_type": "ernie4_5_moe",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "max_sequence_length": 131072,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": c.num_hidden_layers,
        "rms_norm_eps": 1e-05,
        "use_cache": True,
        "vocab_size": c.vocab_size,
        "rope_theta": spec["rope_theta"],
        "use_bias": False,
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "dtype": "bfloat16",
        "moe_num_experts": c.moe_num_experts,
        "moe_layer_start_index": c.moe_layer_start_index,
        "moe_layer_end_index": c.moe_layer_end_index,  # explicit (HF resolved -1)
        "moe_layer_interval": c.moe_layer_interval,
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_capacity": [64, 64, 64],
        "moe_gate": "topk",
        "moe_k": c.moe_k,
        "moe_num_shared_experts": c.moe_num_shared_experts,
        "moe_use_aux_free": True,
        "moe_aux_loss_lambda": 1e-05,
        "moe_z_loss_lambda": 0.0,
        "moe_orthogonal_loss_lambda": 0.0,
        "moe_group_orthogonal_loss": True,
        "global_aux_loss": False,
        "num_nextn_predict_layers": 1,
        # Paddle-only switches (no effect on inference math)
        "add_tail_layers": False,
        "compression_ratio": 1.0,
        "fuse_gate_detach_matmul": True,
        "fuse_linear": False,
        "fuse_ln": False,
        "fuse_rms_norm": True,
        "fuse_rope": False,
        "fuse_swiglu": True,
        "use_fast_ln": False,
        "use_flash_attention": True,
        "use_rmsnorm": True,
        "model_name": f"ernie45-moe-golden-{spec['name']}",
        "paddlenlp_version": "3.0.0",
    }
    if spec["head_dim"] is not None:
        cfg["head_dim"] = spec["head_dim"]
    return cfg


GENERATION_CONFIG = {
    "do_sample": True, "top_p": 0.8, "temperature": 0.8, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
}


def is_fp32_key(name: str) -> bool:
    return name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")


def encode(name: str, arr: np.ndarray, bf16_dtype: str, fp32_keys_dtype: str):
    """Return (header dtype, raw array) for one tensor."""
    dt = fp32_keys_dtype if is_fp32_key(name) else bf16_dtype
    if dt == "F32":
        return dt, np.ascontiguousarray(arr, dtype=np.float32)
    return dt, bf16_bits(arr)  # U16 and BF16 hold the same bit patterns


def write_paddle(spec, model, mtp, out_dir) -> list[str]:
    os.makedirs(out_dir)
    P, M = to_paddle(spec, model, mtp)
    written = []

    def dump_json(obj, fname):
        path = os.path.join(out_dir, fname)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        written.append(path)

    dump_json(paddle_config(spec, model), "config.json")
    dump_json(GENERATION_CONFIG, "generation_config.json")
    meta = {"format": "np"}
    storage = spec["storage"]
    if storage == "single_u16":
        main = dict(P)
        if spec["mtp"] == "main":
            main.update(M)
        enc = {k: encode(k, v, "U16", "F32") for k, v in main.items()}
        path = os.path.join(out_dir, "model.safetensors")
        write_safetensors(path, enc, meta)
        written.append(path)
    elif storage == "sharded_bf16":
        assert spec["mtp"] is None
        enc = {k: encode(k, v, "BF16", "U16") for k, v in P.items()}
        names = sorted(enc)
        sizes = [enc[n][1].nbytes for n in names]
        total = int(sum(sizes))
        cum = np.cumsum(sizes)
        cut = int(np.searchsorted(cum, total / 2)) + 1  # first shard: keys up to half the bytes
        shards = [names[:cut], names[cut:]]
        weight_map = {}
        for si, shard in enumerate(shards):
            fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
            path = os.path.join(out_dir, fname)
            write_safetensors(path, {n: enc[n] for n in shard}, meta)
            written.append(path)
            for n in shard:
                weight_map[n] = fname
        dump_json({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                  "model.safetensors.index.json")
    elif storage == "single_bf16":
        enc = {k: encode(k, v, "BF16", "F32") for k, v in P.items()}
        path = os.path.join(out_dir, "model.safetensors")
        write_safetensors(path, enc, meta)
        written.append(path)
        if spec["mtp"] == "subfolder":
            os.makedirs(os.path.join(out_dir, "mtp"))
            path = os.path.join(out_dir, "mtp", "model.safetensors")
            write_safetensors(path, {k: encode(k, v, "BF16", "F32") for k, v in M.items()}, meta)
            written.append(path)
    else:
        raise ValueError(storage)
    return written


def load_paddle_dir(d: str) -> tuple[dict, dict]:
    """Own reader: all *.safetensors in d (via the index if present) and d/mtp. -> (tensors, dtypes)."""
    files = []
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    if os.path.isdir(os.path.join(d, "mtp")):
        files.append(os.path.join("mtp", "model.safetensors"))
    T, D = {}, {}
    for fn in files:
        for k, (dt, a) in read_safetensors(os.path.join(d, fn)).items():
            assert k not in T, k
            T[k], D[k] = a, dt
    if os.path.exists(idx):
        total = sum(a.size * (4 if D[k] == "F32" else 2) for k, a in T.items() if not k.startswith("ernie.mtp"))
        assert total == index["metadata"]["total_size"], (total, index["metadata"]["total_size"])
        assert set(index["weight_map"]) == set(T)
    return T, D


# --------------------------------------------------------------------------------------------
# Goldens from the HF torch model
# --------------------------------------------------------------------------------------------

def causal_mask(T: int) -> torch.Tensor:
    m = torch.full((T, T), torch.finfo(torch.float32).min, dtype=torch.float32).triu(1)
    return m[None, None]


@torch.no_grad()
def mtp_forward(model, mtp, input_ids: torch.Tensor) -> torch.Tensor:
    """MTP logits, the definition stored as ``mtp_logits`` (spec section 5.1, FastDeploy variant).

    h   = model.model(input_ids).last_hidden_state      # final-NORMED main hidden state [B,T,H]
    for t = 0..T-2 (all at once, causal over the T-1 positions):
      e   = embed(input_ids[:, t+1])                    # shared main embedding
      z   = concat([mtp_emb_norm(e), mtp_hidden_norm(h[:, t])], -1)   # EMBEDDING FIRST
      u   = z @ W_mtp_linear_proj                       # Paddle [2H, H]
      u   = mtp_block(u)                                # full decoder layer, dense FFN (width
                                                        # intermediate_size), causal attention,
                                                        # RoPE positions 0..T-2
      out = main final norm(u)                          # ernie.norm (shared)
      mtp_logits[:, t] = out @ lm_head                  # tied: embed.T
    Result [B, T-1, V]; row t predicts token t+2.
    """
    B, T = input_ids.shape
    h = model.model(input_ids=input_ids).last_hidden_state
    e = model.model.embed_tokens(input_ids[:, 1:])
    z = torch.cat([mtp.emb_norm(e), mtp.hid_norm(h[:, :-1])], dim=-1)
    u = mtp.linear_proj(z)
    pos = torch.arange(T - 1)[None].expand(B, -1)
    pe = model.model.rotary_emb(u, pos)
    u = mtp.block(u, attention_mask=causal_mask(T - 1), position_ids=pos, position_embeddings=pe)
    return model.lm_head(model.model.norm(u))


@torch.no_grad()
def compute_goldens(spec, model, mtp) -> dict:
    c = model.config
    rng = np.random.default_rng(spec["seed"])
    V = c.vocab_size
    input_ids = rng.integers(3, V, size=(BATCH, SEQ_LEN)).astype(np.int32)
    greedy_prompt = rng.integers(3, V, size=(BATCH, PROMPT_LEN)).astype(np.int32)
    ids = torch.from_numpy(input_ids).long()

    # ---- full forward + router capture
    captured = []
    moe_layers = [i for i in range(c.num_hidden_layers)
                  if is_moe_layer(i, c.moe_layer_start_index, c.moe_layer_end_index, c.moe_layer_interval)]
    hooks = []
    for i in moe_layers:
        gate = model.model.layers[i].mlp.gate
        assert isinstance(gate, hf_ernie.Ernie4_5_MoeTopKRouter)
        hooks.append(gate.register_forward_hook(lambda mod, inp, out, i=i: captured.append((i, out))))
    pos = torch.arange(SEQ_LEN)[None].expand(BATCH, -1)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    for h in hooks:
        h.remove()
    assert [i for i, _ in captured] == moe_layers, [i for i, _ in captured]
    # position_ids default gives the same result
    assert torch.equal(logits, model(input_ids=ids, use_cache=False).logits)

    topk_idx, topk_w = [], []
    for _, (router_logits, weights, selected) in captured:
        sel = selected.numpy()
        w = weights.float().numpy()
        order = np.argsort(sel, axis=-1, kind="stable")
        topk_idx.append(np.take_along_axis(sel, order, -1).astype(np.int32))
        topk_w.append(np.take_along_axis(w, order, -1).astype(np.float32))
    topk_experts = np.stack(topk_idx)  # [n_moe, B*T, k]
    topk_weights = np.stack(topk_w)

    # ---- greedy decoding, one prompt at a time
    greedy = []
    for b in range(BATCH):
        p = torch.from_numpy(greedy_prompt[b:b + 1]).long()
        out = model.generate(
            input_ids=p, attention_mask=torch.ones_like(p), do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            eos_token_id=None, pad_token_id=0, use_cache=True,
        )
        gen = out[0, PROMPT_LEN:].numpy()
        assert gen.shape == (NEW_TOKENS,), gen.shape
        # reference: plain argmax with full recomputation (no cache, no logits processors)
        seq = p
        ref = []
        for _ in range(NEW_TOKENS):
            nxt = model(input_ids=seq, use_cache=False).logits[0, -1].argmax()
            ref.append(int(nxt))
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        assert list(gen) == ref, (gen, ref)
        greedy.append(gen.astype(np.int32))
    greedy_tokens = np.stack(greedy)

    g = {
        "input_ids": input_ids,
        "logits": logits.numpy().astype(np.float32),
        "topk_experts": topk_experts,
        "topk_weights": topk_weights,
        "greedy_prompt": greedy_prompt,
        "greedy_tokens": greedy_tokens,
    }
    if mtp is not None:
        g["mtp_logits"] = mtp_forward(model, mtp, ids).numpy().astype(np.float32)
    return g


# --------------------------------------------------------------------------------------------
# Independent numpy reference forward over the Paddle tensors (float64)
# --------------------------------------------------------------------------------------------

class NumpyRef:
    def __init__(self, cfg: dict, W: dict, rope="interleaved", use_bias=True):
        self.c = cfg
        self.W = {k: v.astype(np.float64) for k, v in W.items()}
        self.H = cfg["hidden_size"]
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg["num_key_value_heads"]
        self.d = cfg.get("head_dim") or self.H // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.rope = rope
        self.use_bias = use_bias
        self.routing = {}

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.eps) * w

    def apply_rope(self, x, pos):  # x [B,T,h,d]
        d = self.d
        inv = self.c["rope_theta"] ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = (pos[:, None] / self.c.get("compression_ratio", 1.0)) * inv[None]  # [T, d/2]
        cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        if self.rope == "interleaved":
            x0, x1 = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2] = x0 * cos - x1 * sin
            out[..., 1::2] = x1 * cos + x0 * sin
        else:  # NeoX rotate-half (WRONG for ERNIE; used only to show the fixture catches it)
            h = d // 2
            x0, x1 = x[..., :h], x[..., h:]
            out = np.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1)
        return out

    def attn(self, x, pre, pos):
        B, T, _ = x.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        qkv = x @ self.W[pre + "self_attn.qkv_proj.weight"]
        q = qkv[..., :nh * d].reshape(B, T, nh, d)
        k = qkv[..., nh * d:(nh + nkv) * d].reshape(B, T, nkv, d)
        v = qkv[..., (nh + nkv) * d:].reshape(B, T, nkv, d)
        q, k = self.apply_rope(q, pos), self.apply_rope(k, pos)
        k = np.repeat(k, nh // nkv, axis=2)
        v = np.repeat(v, nh // nkv, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        s = np.where(np.tril(np.ones((T, T), bool))[None, None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", s, v).reshape(B, T, nh * d)
        return o @ self.W[pre + "self_attn.o_proj.weight"]

    def swiglu(self, x, ug, dn):
        u = x @ ug
        i = u.shape[-1] // 2
        g = u[..., :i]
        return (g / (1 + np.exp(-g)) * u[..., i:]) @ dn

    def moe(self, x, pre, layer):
        B, T, H = x.shape
        x2 = x.reshape(-1, H)
        logits = x2 @ self.W[pre + "mlp.gate.weight"]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        score = p + (self.W[pre + "mlp.moe_statics.e_score_correction_bias"] if self.use_bias else 0.0)
        k = self.c["moe_k"]
        sel = np.argsort(-score, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(p, sel, -1)
        w = w / np.maximum(w.sum(-1, keepdims=True), 1e-12)
        y = np.zeros_like(x2)
        for e in range(self.c["moe_num_experts"]):
            rows, slot = np.nonzero(sel == e)
            if rows.size:
                y[rows] += w[rows, slot, None] * self.swiglu(
                    x2[rows], self.W[pre + f"mlp.experts.{e}.up_gate_proj.weight"],
                    self.W[pre + f"mlp.experts.{e}.down_proj.weight"])
        if self.c["moe_num_shared_experts"] > 0:
            y += self.swiglu(x2, self.W[pre + "mlp.shared_experts.up_gate_proj.weight"],
                             self.W[pre + "mlp.shared_experts.down_proj.weight"])
        o = np.argsort(sel, -1)
        self.routing[layer] = (np.take_along_axis(sel, o, -1), np.take_along_axis(w, o, -1))
        return y.reshape(B, T, H)

    def layer(self, x, pre, pos, moe, layer=None):
        x = x + self.attn(self.rms(x, self.W[pre + "input_layernorm.weight"]), pre, pos)
        h = self.rms(x, self.W[pre + "post_attention_layernorm.weight"])
        if moe:
            return x + self.moe(h, pre, layer)
        return x + self.swiglu(h, self.W[pre + "mlp.up_gate_proj.weight"], self.W[pre + "mlp.down_proj.weight"])

    def head(self, h):
        if self.c["tie_word_embeddings"]:
            return h @ self.W["ernie.embed_tokens.weight"].T
        return h @ self.W["lm_head.weight"]

    def hidden(self, ids):
        c = self.c
        x = self.W["ernie.embed_tokens.weight"][ids]
        pos = np.arange(ids.shape[1], dtype=np.float64)
        for i in range(c["num_hidden_layers"]):
            moe = is_moe_layer(i, c["moe_layer_start_index"], c["moe_layer_end_index"], c["moe_layer_interval"])
            x = self.layer(x, f"ernie.layers.{i}.", pos, moe, i)
        return self.rms(x, self.W["ernie.norm.weight"])

    def logits(self, ids):
        return self.head(self.hidden(ids))

    def mtp_logits(self, ids, swap_concat=False):
        h = self.hidden(ids)
        e = self.W["ernie.embed_tokens.weight"][ids[:, 1:]]
        a = self.rms(e, self.W["ernie.mtp_emb_norm.0.weight"])
        b = self.rms(h[:, :-1], self.W["ernie.mtp_hidden_norm.0.weight"])
        z = np.concatenate([b, a] if swap_concat else [a, b], -1)
        u = z @ self.W["ernie.mtp_linear_proj.0.weight"]
        u = self.layer(u, "ernie.mtp_block.0.", np.arange(ids.shape[1] - 1, dtype=np.float64), False)
        return self.head(self.rms(u, self.W["ernie.norm.weight"]))


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def verify_paddle(spec, pdir: str, g: dict) -> None:
    with open(os.path.join(pdir, "config.json")) as f:
        cfg = json.load(f)
    W, D = load_paddle_dir(pdir)
    # header dtypes are what the spec says for this model
    want = {"single_u16": ("U16", "F32"), "sharded_bf16": ("BF16", "U16"), "single_bf16": ("BF16", "F32")}[spec["storage"]]
    for k, dt in D.items():
        assert dt == (want[1] if is_fp32_key(k) else want[0]), (k, dt)
    # the safetensors library can open every file too (torch framework knows U16 and BF16)
    from safetensors import safe_open
    for root, _, fns in os.walk(pdir):
        for fn in fns:
            if fn.endswith(".safetensors"):
                with safe_open(os.path.join(root, fn), framework="pt") as f:
                    for k in f.keys():
                        t = f.get_tensor(k)
                        t = t.view(torch.bfloat16) if t.dtype == torch.uint16 else t
                        assert np.array_equal(t.float().numpy(), W[k]), k

    ids = g["input_ids"].astype(np.int64)
    ref = NumpyRef(cfg, W)
    lg = ref.logits(ids)
    err = rel_err(g["logits"], lg)
    assert err < 1e-4, f"numpy Paddle forward vs HF logits rel err {err}"
    layers = sorted(ref.routing)
    for j, L in enumerate(layers):
        sel, w = ref.routing[L]
        assert np.array_equal(sel, g["topk_experts"][j]), f"routing mismatch in layer {L}"
        assert np.max(np.abs(w - g["topk_weights"][j])) < 1e-5
    msg = f"  numpy-from-Paddle forward matches HF: logits rel err {err:.2e}, routing identical"
    if "mtp_logits" in g:
        assert any(k.startswith("ernie.mtp_") for k in W)
        mlg = ref.mtp_logits(ids)
        merr = rel_err(g["mtp_logits"], mlg)
        assert merr < 1e-4, f"MTP rel err {merr}"
        msg += f"; mtp rel err {merr:.2e}"
        swap = rel_err(g["mtp_logits"], ref.mtp_logits(ids, swap_concat=True))
        msg += f" (swapped concat would give {swap:.2f})"
    print(msg)
    # sensitivity: typical bugs must show up clearly in the fixtures
    neox = rel_err(g["logits"], NumpyRef(cfg, W, rope="neox").logits(ids))
    nb = NumpyRef(cfg, W, use_bias=False)
    nb.logits(ids)
    changed = sum(int(np.sum(np.any(nb.routing[L][0] != g["topk_experts"][j], -1))) for j, L in enumerate(layers))
    print(f"  sensitivity: NeoX RoPE -> logits rel err {neox:.2f}; dropping the correction bias "
          f"changes the expert set of {changed}/{len(layers) * ids.size} token-layer routings")
    assert neox > 1e-2 and changed > 0


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def write_hf(model, hdir: str, g: dict) -> list[str]:
    model.save_pretrained(hdir)
    re = Ernie4_5_MoeForCausalLM.from_pretrained(hdir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        lg = re(input_ids=torch.from_numpy(g["input_ids"]).long(), use_cache=False).logits.numpy()
    assert np.array_equal(lg, g["logits"]), "HF reload changed the logits"
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), re.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    return sorted(os.path.join(hdir, f) for f in os.listdir(hdir))


def summarize(spec, g):
    lg = g["logits"]
    print(f"  logits {lg.shape}: mean {lg.mean():+.3f} std {lg.std():.3f} "
          f"(per-row std {lg.std(-1).mean():.3f}), max|.| {np.abs(lg).max():.2f}")
    for j in range(g["topk_experts"].shape[0]):
        te = g["topk_experts"][j]
        counts = np.bincount(te.ravel(), minlength=spec["hf"]["moe_num_experts"])
        print(f"  moe #{j}: distinct experts {int((counts > 0).sum())}/{len(counts)}, counts {counts.tolist()}, "
              f"distinct top-k sets {len({tuple(r) for r in te})}")
        assert (counts > 0).sum() >= min(3, len(counts))
    print(f"  greedy_tokens {g['greedy_tokens'].tolist()}")
    for row in g["greedy_tokens"]:
        assert len(set(row.tolist())) >= 4, "greedy output too repetitive to be a useful test"
    if "mtp_logits" in g:
        print(f"  mtp_logits {g['mtp_logits'].shape}: std {g['mtp_logits'].std():.3f}")


README = """\
# Golden fixtures for ernie_jax

Each folder holds one tiny random-weight ERNIE-4.5 MoE model (`shared_untied`: shared experts,
untied head, MTP in the main file; `noshared_tied`: no shared experts, tied head, two BF16 shards
with an index; `interval2_headdim`: MoE every 2nd layer, explicit `head_dim` 32 != hidden/heads,
MTP in `paddle/mtp/`). `hf/` is the HF transformers `save_pretrained` copy (fp32), and `paddle/`
is the same weights in the official Paddle release layout (`ernie.` prefix, [in, out] linears, fused
qkv/up_gate, bf16 stored as `U16` or `BF16`, router/bias as `F32` or `U16`, Paddle config keys).
Every weight is exactly bf16-representable, so both copies hold identical numbers. `golden.npz`
holds fp32 reference outputs from the HF torch model: `input_ids` [2,11], `logits` [2,11,V],
`topk_experts`/`topk_weights` [n_moe_layers,22,k] (sorted by expert id), `greedy_prompt` [2,5],
`greedy_tokens` [2,12], and for the MTP models `mtp_logits` [2,10,V]; the exact definitions are in
the docstrings of `tests/make_golden.py`. Regenerate with `python tests/make_golden.py` (needs
torch + transformers; it deletes and rewrites these folders and checks the Paddle files with an
independent numpy forward).
"""


def main():
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    all_written = []
    for spec in MODELS:
        print(f"== {spec['name']}")
        mdir = os.path.join(GOLDEN_DIR, spec["name"])
        if os.path.exists(mdir):
            shutil.rmtree(mdir)
        os.makedirs(mdir)
        model = build_hf_model(spec)
        c = model.config
        hd = spec["head_dim"] or c.hidden_size // c.num_attention_heads
        assert model.model.layers[0].self_attn.head_dim == hd
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (c.num_attention_heads * hd, c.hidden_size)
        assert model.model.rotary_emb.inv_freq.shape == (hd // 2,)
        mtp = None
        if spec["mtp"]:
            mtp = MTP(c).eval()
            mtp.init_(spec["std_linear"])  # continues the same torch RNG stream
        g = compute_goldens(spec, model, mtp)
        all_written += write_hf(model, os.path.join(mdir, "hf"), g)
        all_written += write_paddle(spec, model, mtp, os.path.join(mdir, "paddle"))
        npz = os.path.join(mdir, "golden.npz")
        np.savez_compressed(npz, **g)
        all_written.append(npz)
        summarize(spec, g)
        verify_paddle(spec, os.path.join(mdir, "paddle"), g)
        for k, v in g.items():
            print(f"  npz {k}: {v.dtype} {list(v.shape)}")
    with open(os.path.join(GOLDEN_DIR, "README.md"), "w") as f:
        f.write(README)
    all_written.append(os.path.join(GOLDEN_DIR, "README.md"))
    print("files written:")
    for p in all_written:
        print(f"  {os.path.relpath(p, os.path.dirname(GOLDEN_DIR))}  ({os.path.getsize(p)} B)")


if __name__ == "__main__":
    sys.exit(main())

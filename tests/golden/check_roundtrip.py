#!/usr/bin/env python3
"""Round-trip check: a model directory saved by tandem (HF format) still gives the golden logits.

Loads DIR with transformers' AutoModelForCausalLM (f32), runs the golden packed batch (each
sequence on its own, positions restarting at 0) and compares the logits with GOLDEN's "logits"
within a relative tolerance: max |logits - golden| <= rtol * max |golden|.
Exits 0 on success, 1 with a message naming what differs otherwise.

Usage: check_roundtrip.py DIR GOLDEN [--rtol 1e-5]
"""

import argparse
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def fail(msg):
    print(f"check_roundtrip: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="model directory (config.json + *.safetensors)")
    ap.add_argument("golden", help="golden.safetensors written by make_model_golden.py")
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args()

    try:
        golden = load_file(args.golden)
    except (OSError, SafetensorError) as e:
        fail(f"{args.golden}: cannot read: {e}")
    prompts = "prompt0.ids" in golden  # the SmolLM2 golden: per-prompt last logits
    for key in ("prompt0.ids", "prompt0.logits_last") if prompts else ("input_ids", "cu_seqlens", "logits"):
        if key not in golden:
            fail(f"{args.golden}: tensor '{key}' missing")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            args.dir, dtype=torch.float32, attn_implementation="eager"
        )
    except (OSError, ValueError) as e:
        fail(f"{args.dir}: cannot load as a Hugging Face model: {e}")
    model.eval()

    if prompts:
        # Each prompt on its own; compare the logits of its last two positions.
        n = len([k for k in golden if k.endswith(".ids")])
        ids = torch.cat([golden[f"prompt{i}.ids"] for i in range(n)])
        cu = torch.tensor([0] + [len(golden[f"prompt{i}.ids"]) for i in range(n)]).cumsum(0)
        want = torch.cat([golden[f"prompt{i}.logits_last"] for i in range(n)]).double()
    else:
        ids, cu, want = golden["input_ids"], golden["cu_seqlens"], golden["logits"].double()
    if want.shape[1] != model.config.vocab_size:
        fail(
            f"{args.dir}: vocab_size {model.config.vocab_size}, golden logits have "
            f"{want.shape[1]} columns"
        )
    with torch.no_grad():
        got = torch.cat(
            [
                model(input_ids=ids[int(cu[b]) : int(cu[b + 1])].long()[None], use_cache=False)
                .logits[0, -2 if prompts else 0 :]
                .double()
                for b in range(len(cu) - 1)
            ]
        )
    if got.shape != want.shape:
        fail(f"logits shape {tuple(got.shape)}, golden {tuple(want.shape)}")
    diff = (got - want).abs()
    scale = want.abs().max().item()
    worst = diff.max().item()
    if not worst <= args.rtol * scale:  # also catches NaN
        t, v = divmod(int(diff.argmax()), want.shape[1])
        fail(
            f"{args.dir}: logits differ from {args.golden}: max |diff| {worst:.3e} > "
            f"{args.rtol:g} * max |golden| ({scale:.3e}); worst at token {t} vocab {v}: "
            f"got {got[t, v].item():.6f}, expected {want[t, v].item():.6f}"
        )
    print(
        f"check_roundtrip: OK: {args.dir}: max |diff| {worst:.3e} <= {args.rtol:g} * {scale:.3e}"
    )


if __name__ == "__main__":
    main()

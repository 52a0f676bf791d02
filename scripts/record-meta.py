"""Records a training trace on the meta device (no GPU, no memory): a
`transformers` model built from a config, AdamW, N steps, under
`wasmem.torch.Recorder`, in the shape of loop asked for. Used for the
recorded rows of docs/measurements.md.

    python scripts/record-meta.py gpt2 6 gpt2.jsonl.gz
    python scripts/record-meta.py llama-small 16 l.jsonl.gz --varseq --keep-outputs
    wasmem compare gpt2.jsonl.gz --policy planned --policy defrag --policy pytorch

Loop shapes: `--keep-outputs` keeps the model's output until the next
forward returns (`out = model(...)`, as many Hugging Face loops do);
`--varseq` draws each batch's sequence length from 1/4, 1/2, 3/4 or all of
the model's (seeded); `--accum K` accumulates K micro-batches per optimizer
step; `--eval-every N` runs a forward under `torch.no_grad()` after every
N-th optimizer step (on the last training batch, or with `--eval-batches K`
on K held-out batches, the same at every evaluation: a fixed evaluation
set, its lengths drawn once with `--varseq`); `--checkpointing` recomputes activations in the
backward (`gradient_checkpointing_enable`, eager attention); `--bf16` trains in bfloat16;
`--optim sgd` uses SGD with momentum instead of AdamW; `--grads-kept`
zeroes gradients in place (`zero_grad(set_to_none=False)`) instead of
freeing them; `--foreach` runs the optimizer's multi-tensor path (CUDA's
default: whole lists of temporaries at the step); `--clip` clips the
gradients' norm to 1.0 before each optimizer step (`clip_grad_norm_`).

Needs torch, transformers and the wasmem package (`pip install ./python`).
"""

import argparse
import random
import time

import torch
import transformers

import wasmem.torch as wt

SHAPES = {
    # GPT-2 small (124 M), batch 8 x 1024
    "gpt2": (lambda: transformers.GPT2Config(), (8, 1024)),
    # GPT-2 of 6 layers, batch 8 x 1024
    "gpt2-6": (lambda: transformers.GPT2Config(n_layer=6), (8, 1024)),
    # Llama-shaped, 16 layers of width 2048, batch 2 x 2048
    "llama": (
        lambda: transformers.LlamaConfig(
            hidden_size=2048,
            intermediate_size=5504,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=32000,
        ),
        (2, 2048),
    ),
    # Llama-shaped, 8 layers of width 1024, grouped-query attention, batch 4 x 1024
    "llama-small": (
        lambda: transformers.LlamaConfig(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
        ),
        (4, 1024),
    ),
    # BERT base, masked language modelling, batch 16 x 512
    "bert": (lambda: transformers.BertConfig(), (16, 512)),
    # Qwen2-shaped: a 151,936-token vocabulary (large logits), tied
    # embeddings, 6 layers of width 896, batch 4 x 1024
    "qwen2-small": (
        lambda: transformers.Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=6,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        (4, 1024),
    ),
    # ViT base, image classification, batch 32 x 224 x 224 (the second
    # number is the image side)
    "vit": (lambda: transformers.ViTConfig(num_labels=1000), (32, 224)),
    # T5 small (encoder-decoder), batch 8, 512 tokens in, 128 out
    "t5-small": (lambda: transformers.T5Config(decoder_start_token_id=0, pad_token_id=0), (8, 512)),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(SHAPES))
    ap.add_argument("steps", type=int)
    ap.add_argument("output")
    ap.add_argument("--keep-outputs", action="store_true", help="keep each output until the next forward returns")
    ap.add_argument("--varseq", action="store_true", help="a sequence length drawn per batch")
    ap.add_argument("--accum", type=int, default=1, metavar="K", help="micro-batches per optimizer step")
    ap.add_argument("--eval-every", type=int, default=0, metavar="N", help="a no-grad forward every N steps")
    ap.add_argument("--eval-batches", type=int, default=0, metavar="K", help="evaluate K held-out batches")
    ap.add_argument("--checkpointing", action="store_true", help="recompute activations in the backward")
    ap.add_argument("--bf16", action="store_true", help="train in bfloat16")
    ap.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--foreach", action="store_true", help="the optimizer's multi-tensor (foreach) path")
    ap.add_argument("--clip", action="store_true", help="clip the gradients' norm to 1.0 before each step")
    ap.add_argument("--grads-kept", action="store_true", help="zero gradients in place instead of freeing them")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 1 or args.accum < 1 or args.eval_every < 0 or args.eval_batches < 0:
        ap.error("steps and --accum must be at least 1, --eval-every and --eval-batches at least 0")
    make_config, (batch, seq) = SHAPES[args.model]
    config = make_config()
    rng = random.Random(args.seed)
    held = random.Random(args.seed + 1)
    eval_lengths = [
        held.choice([seq // 4, seq // 2, 3 * seq // 4, seq]) if args.varseq else seq for _ in range(args.eval_batches)
    ]
    t = time.time()
    with wt.Recorder(device="meta") as rec:
        if args.model == "bert":
            model = transformers.BertForMaskedLM(config)
        elif args.model == "t5-small":
            model = transformers.T5ForConditionalGeneration(config)
        elif args.model == "vit":
            model = transformers.ViTForImageClassification(config)
        elif args.checkpointing:
            # Without a KV cache (checkpointing turns it off), transformers'
            # SDPA masks read tensors (`.item()`), which the meta device
            # cannot: eager attention with an explicit mask does not.
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
        if args.bf16:
            model = model.to(torch.bfloat16)
        if args.checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        if args.optim == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=args.foreach)
        else:
            opt = torch.optim.AdamW(model.parameters(), foreach=args.foreach)
        rec.track(model, opt)
        out = None
        for step in range(args.steps):
            for _ in range(args.accum):
                length = rng.choice([seq // 4, seq // 2, 3 * seq // 4, seq]) if args.varseq else seq
                if args.model == "vit":
                    # Images have one size: drawn lengths do not apply.
                    ids = torch.randn(batch, 3, seq, seq)
                    out = model(pixel_values=ids, labels=torch.randint(0, 1000, (batch,)))
                elif args.model == "t5-small":
                    ids = torch.randint(0, config.vocab_size, (batch, length))
                    labels = torch.randint(0, config.vocab_size, (batch, max(length // 4, 1)))
                    out = model(input_ids=ids, labels=labels)
                elif args.checkpointing:
                    ids = torch.randint(0, config.vocab_size, (batch, length))
                    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
                else:
                    ids = torch.randint(0, config.vocab_size, (batch, length))
                    out = model(input_ids=ids, labels=ids)
                out.loss.backward()
                if not args.keep_outputs:
                    out = None
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=not args.grads_kept)
            if args.eval_every and (step + 1) % args.eval_every == 0:
                with torch.no_grad():
                    if args.model == "vit":
                        model(pixel_values=ids)
                        continue
                    batches = [(ids, labels if args.model == "t5-small" else ids)]
                    if eval_lengths:
                        batches = []
                        for length in eval_lengths:
                            e = torch.randint(0, config.vocab_size, (batch, length))
                            t5 = args.model == "t5-small"
                            batches.append((e, torch.randint(0, config.vocab_size, (batch, max(length // 4, 1))) if t5 else e))
                    for e, lab in batches:
                        model(input_ids=e, labels=lab)
        del out
        rec.save(args.output)
    print(f"recorded {args.model}, {args.steps} steps, in {time.time() - t:.1f} s: {args.output}")


if __name__ == "__main__":
    main()

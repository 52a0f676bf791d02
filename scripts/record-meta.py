"""Records a training trace on the meta device (no GPU, no memory): a
`transformers` model built from a config, AdamW, N steps, under
`wasmem.torch.Recorder`. Used for the recorded rows of docs/measurements.md.

    python scripts/record-meta.py gpt2 6 gpt2.jsonl.gz
    python scripts/record-meta.py llama 6 llama.jsonl.gz
    wasmem compare gpt2.jsonl.gz --policy planned --policy defrag --policy pytorch

Needs torch, transformers and the wasmem package (`pip install ./python`).
"""

import argparse
import time

import torch
import transformers

import wasmem.torch as wt

SHAPES = {
    # GPT-2 small (124 M), batch 8 x 1024
    "gpt2": (lambda: transformers.GPT2Config(), (8, 1024)),
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
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(SHAPES))
    ap.add_argument("steps", type=int)
    ap.add_argument("output")
    args = ap.parse_args()
    make_config, shape = SHAPES[args.model]
    config = make_config()
    t = time.time()
    with wt.Recorder(device="meta") as rec:
        model = transformers.AutoModelForCausalLM.from_config(config)
        opt = torch.optim.AdamW(model.parameters())
        rec.track(model, opt)
        for _ in range(args.steps):
            ids = torch.randint(0, config.vocab_size, shape)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        rec.save(args.output)
    print(f"recorded {args.model}, {args.steps} steps, in {time.time() - t:.1f} s: {args.output}")


if __name__ == "__main__":
    main()

"""Activation bytes per token per layer on this device (saved-tensor hooks) against flexsp.plan.memory's model.

    python experiments/activations_check.py OUT.json [big]   # big: the Llama-3-8B layer shape (a GPU run)
"""
import dataclasses, json, sys, torch
from flexsp.plan.specs import ModelSpec
from flexsp.plan.layers import FULL
from flexsp.plan.memory import layer_activation_bytes
from flexsp.profile.activations import bytes_per_token_layer
from flexsp.runtime import TinyLM
dev = "cuda" if torch.cuda.is_available() else "cpu"
big = len(sys.argv) > 2
spec = ModelSpec(layers=2, hidden=4096 if big else 256, heads=32 if big else 4, kv_heads=8 if big else 2,
                 ffn=14336 if big else 688, vocab=512)
toks = (1024, 2048) if big else (128, 256)
rows = []
for precision in ("autocast", "bf16"):
    for recompute in ("none", "selective", "full"):
        m = bytes_per_token_layer(lambda n: TinyLM(dataclasses.replace(spec, layers=n)).to(dev), precision, recompute, tokens=toks)
        p = layer_activation_bytes(spec, FULL, recompute, precision)
        rows.append(dict(model="TinyLM", device=dev, hidden=spec.hidden, precision=precision, recompute=recompute,
                         measured=m, modelled=p, rel=(p - m) / m))
        print(rows[-1], flush=True)
try:
    from flexsp.hf.prepare import from_config, tiny_config
    from flexsp.plan.specs import spec_from_hf_config
    hs = dataclasses.replace(spec, hidden=1024 if big else 256, heads=8 if big else 4, kv_heads=2, ffn=3584 if big else 688)
    def build(n):
        cfg = tiny_config("llama", num_hidden_layers=n, hidden_size=hs.hidden, num_attention_heads=hs.heads,
                          num_key_value_heads=hs.kv_heads, intermediate_size=hs.ffn, vocab_size=hs.vocab, head_dim=hs.head_size)
        return from_config(cfg, dtype=torch.float32).to(dev)
    hspec = spec_from_hf_config(build(1).model.config)
    for precision in ("autocast", "bf16"):
        m = bytes_per_token_layer(build, precision, "none", tokens=toks)
        p = layer_activation_bytes(hspec, FULL, "none", precision)
        rows.append(dict(model="HF llama", device=dev, hidden=hs.hidden, precision=precision, recompute="none",
                         measured=m, modelled=p, rel=(p - m) / m))
        print(rows[-1], flush=True)
except Exception as e:
    print("hf part failed:", repr(e)[:300])
json.dump(rows, open(sys.argv[1], "w"), indent=1)

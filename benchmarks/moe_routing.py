"""How an MoE made by `ft checkpoint moe-from-dense` routes a real text it was not fitted to,
beside uniform random top-k routing: the share of tokens whose top-k set (and first choice)
equals the previous token's, the experts' loads, and the softmax mass outside the top k (what
llama.cpp, which does not renormalise qwen2moe's weights, leaves out).

    python benchmarks/moe_routing.py DENSE.gguf [MOE.gguf] [--tokens 2048]

MOE.gguf defaults to the cached MoE of DENSE.gguf (8 experts, top-2; made if missing). The
held-out text is the source of Python's json.decoder and textwrap modules (the routers are
fitted to argparse's); the MLP inputs are the dense model's (the MoE's equal them)."""

from __future__ import annotations

import argparse
import inspect
import json.decoder
import textwrap
from pathlib import Path

import numpy as np
import torch

from freetoken.models import moe_from_dense


def routers(moe: Path) -> moe_from_dense.Routing:
    import gguf

    reader = gguf.GGUFReader(str(moe))
    rows = sorted(
        (int(t.name.split(".")[1]), torch.from_numpy(np.array(t.data)))
        for t in reader.tensors
        if t.name.endswith("ffn_gate_inp.weight")
    )
    top_k = int(reader.fields["qwen2moe.expert_used_count"].contents())
    return moe_from_dense.Routing([r for _, r in rows], top_k, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dense", type=Path)
    p.add_argument("moe", type=Path, nargs="?")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of each text")
    args = p.parse_args()
    moe = args.moe or moe_from_dense.cached(args.dense)
    routing = routers(moe)
    model, tokenizer = moe_from_dense.reference_model(args.dense)
    texts = {
        "fitting text (argparse)": moe_from_dense.default_text(),
        "held out (json.decoder + textwrap)": Path(inspect.getsourcefile(json.decoder)).read_text()
        + Path(inspect.getsourcefile(textwrap)).read_text(),
    }
    experts = routing.routers[0].shape[0]
    print(
        f"{args.dense.name} -> {moe.name}: {len(routing.routers)} layers, {experts} experts, "
        f"top-{routing.top_k}\n"
    )
    print(
        "| text | tokens | same top-k set as previous | same first choice | expert load "
        "min / max (mean over layers) | mass outside top-k |"
    )
    print("|---|---|---|---|---|---|")
    for name, text in texts.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
        s = moe_from_dense.routing_stats(moe_from_dense.layer_inputs(model, ids), routing)
        print(
            f"| {name} | {len(ids)} | {s['same_set_as_previous']:.3f} | "
            f"{s['same_first_as_previous']:.3f} | {s['load_min']:.3f} / {s['load_max']:.3f} "
            f"| {s['mass_outside_top_k']:.1e} |"
        )
    print(
        f"| uniform random routing | | {s['same_set_uniform']:.3f} | "
        f"{s['same_first_uniform']:.3f} | {s['load_uniform']:.3f} / {s['load_uniform']:.3f} "
        f"| |"
    )


if __name__ == "__main__":
    main()

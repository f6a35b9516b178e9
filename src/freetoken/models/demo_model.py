"""The model `ft serve`, `ft shell` and `ft generate` run when no `--model` is given: a trained
model that answers, through the expert runtime.

SmolLM2-135M-Instruct (Apache-2.0; its Q4_1 GGUF file fetched once from the package registry,
98 MB, packaged_models.py) made into a Mixture-of-Experts of 8 experts a layer, top 2
(models/moe_from_dense.py: every expert a copy of the layer's MLP in its own Q4_1 blocks, a
router fitted to real text), so a newcomer's first answer comes from a real model through the
host pool, the expert cache and the kernels, and equals the dense model's. It is small enough
for any machine (a 360 MB expert pool) and answers simple questions; it is no coding agent.

The random tiny Qwen3-MoE of freetoken/demo.py stays as the tests' model: it needs no download.
"""

from __future__ import annotations

import json
from pathlib import Path

from freetoken import packaged_models

SOURCE = "smollm2-135m-instruct"
NAME = "freetoken-demo"  # the name it is served under
EXPERTS, TOP_K = 8, 2
# Greedy for `ft shell` / `ft generate`, which follow the checkpoint's settings (a GGUF file
# carries none; the APIs take their own default, temperature 1, where a request sets none): sampled,
# even at the model card's temperature 0.2, this 135M model in Q4_1 began "The capital of France
# is ..." with "L'Étoile" in two of three tries; greedy, it says Paris.
# A 135M model's greedy reply can also repeat itself: a request without an output limit stops
# at 512 tokens rather than at the end of its context.
SAMPLING = {"do_sample": False, "max_new_tokens": 512}
# Its answer sits on a knife edge: after the demo's own question fp32 logits put "The" (then
# "... is Paris") at 25.33 and "L" (then "L'Étoile, la Marseillaise, ...") at 25.24, and bf16
# logits round both to 25.5; which one bf16 picked moved with the CPU's kernels (Paris on a
# Zen 5, L'Étoile on a Zen 1). It computes in fp32, which a 135M model affords anywhere (its
# experts stay in their Q4_1 blocks either way, computed with the file's values).
DTYPE = "float32"
DESCRIPTION = (
    f"the built-in demo model: {SOURCE} made into an MoE of {EXPERTS} experts a layer "
    f"(top {TOP_K}; fetched once from the package registry)"
)


def demo_model(progress: bool | None = None) -> Path:
    """The demo's checkpoint directory: fetched, verified, made into an MoE and converted on
    first use, then read from the cache directory; its generation config recommends greedy
    decoding, its config computing in fp32."""
    # (here, not above: the CLI reads this module's names for its help, before torch loads)
    from freetoken.models import gguf, moe_from_dense

    source = packaged_models.fetch(SOURCE, progress)
    checkpoint = gguf.resolve(moe_from_dense.cached(source, EXPERTS, TOP_K, progress), progress)
    config_file = checkpoint / "generation_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if any(config.get(k) != v for k, v in SAMPLING.items()):
        config_file.write_text(json.dumps({**config, **SAMPLING}))
    model_file = checkpoint / "config.json"  # (what `--dtype auto` follows)
    model = json.loads(model_file.read_text())
    if model.get("dtype") != DTYPE or "torch_dtype" in model:
        model = {k: v for k, v in model.items() if k != "torch_dtype"}
        model_file.write_text(json.dumps({**model, "dtype": DTYPE}, indent=2))
    return checkpoint

"""The driver (``megatron_acrl.train``) with some of the full model's weights frozen: the control
experiment of docs/lora.md "Learning" (does the demo's full-parameter gain survive without the
weights LoRA cannot train?). Not a product knob: a diagnostic run as ``make demo``'s command with
this script in place of ``-m megatron_acrl.train``:

    ACRL_FREEZE=embedding|embedding,norm  python -m launch.torchrun --standalone --nproc-per-node 2 \
        benchmarks/frozen_train.py --config configs/demo.yaml --run-dir DIR [overrides]

``ACRL_UNFREEZE=1`` turns it around: those weights train *besides* the LoRA adapters (a LoRA run,
``model.lora.sync: merged`` so the servers get them too).
``embedding``: the tied word embedding (also the output layer); ``norm``: every RMSNorm weight
(layers' and the final). Freezing is done before DDP and the optimizer are built, on the RL policy
only (the supervised warm start, if not cached, trains everything as usual).
"""

from __future__ import annotations

import os
import sys

from megatron_acrl.world.backends import quiet_absent_backends

quiet_absent_backends()

from megatron_acrl import train  # noqa: E402
from megatron_acrl.megatron.base import ModelTrainer  # noqa: E402

FREEZE = {w for w in os.environ.get("ACRL_FREEZE", "embedding").split(",") if w}
UNFREEZE = os.environ.get("ACRL_UNFREEZE") == "1"
if FREEZE - {"embedding", "norm"}:
    raise SystemExit(f"ACRL_FREEZE={os.environ['ACRL_FREEZE']!r}: use embedding and/or norm")
_build_chunks = ModelTrainer._build_chunks


def _frozen(name: str) -> bool:
    if "embedding" in FREEZE and ("word_embeddings" in name or "output_layer" in name):
        return True
    return "norm" in FREEZE and "norm" in name.rsplit(".", 2)[-2]


def build_chunks_frozen(self: ModelTrainer) -> list:
    chunks = _build_chunks(self)
    t = self.cfg.training
    if t.lr == t.sft_lr and t.min_lr == 0.0 and t.lr_warmup_steps == 0:
        return chunks  # the supervised warm start's trainer (warmstart/sft.py): every weight trains
    names = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if _frozen(name):
                p.requires_grad_(UNFREEZE)
                names.append(name)
    print(f"frozen_train: {'trains' if UNFREEZE else 'froze'} {names}", flush=True)
    return chunks


ModelTrainer._build_chunks = build_chunks_frozen

if __name__ == "__main__":
    sys.exit(train.main())

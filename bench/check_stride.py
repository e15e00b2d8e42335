"""The domain check's position stride: quantkit.eval.compare.score at stride 1 and 4, twice each, on three models
(Gemma-3-270m and two W4AFP8 checkpoints of it), 4 parts of 2 windows of 512 tokens of Persuasion, as the check runs.

Usage: python bench/check_stride.py ORIGINAL CKPT1 CKPT2"""
import sys
import time

import torch

import quantkit
from quantkit.platform import compute
from quantkit.calibration.data import load_text, tokenize
from quantkit.eval.compare import Text, score
from quantkit.eval.ppl import windows

print(compute.machine_summary())
paths = sys.argv[1:4]
models = [quantkit.load(p, dtype=torch.bfloat16) for p in paths]
tok = quantkit.load_tokenizer(paths[0])
ids = tokenize(tok, load_text("persuasion"))
w = windows(ids, 512, 8, None)  # no BOS (as measured on 2026-12-07; only the time and the spread matter here)
texts = [Text(f"part{i}", "0" * 64, w[2 * i:2 * i + 2].flatten(), w[2 * i:2 * i + 2]) for i in range(4)]
for stride in (1, 4, 1, 4):
    t0 = time.perf_counter()
    tallies, _ = score(models, texts, batch_size=2, stride=stride)
    print(f"stride {stride}: {time.perf_counter() - t0:.1f} s; KLD of model 1 per part:",
          [round(t[1].summary()["kld_mean"], 4) for t in tallies], "model 2:", [round(t[2].summary()["kld_mean"], 4) for t in tallies])

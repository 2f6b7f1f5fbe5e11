"""The training and evaluation batches.

- synthetic.py: seed-determined token batches and the batch's shardings (`TOKENS`,
  `synthetic_batch`, `batch_shardings`).
- input_pipeline.py: `make_source(config, global_batch)`, the one entry to every
  dataset, and `put_rows` (a step's rows onto the mesh, each process its own).
- text_data.py (.txt/.jsonl, tokenizing and packing), hf_data.py (parquet),
  sft_data.py and chat_template.py (conversations, masked labels), eval_data.py (the
  eval set), eval_schedule.py (when to evaluate).
"""

from trainer.data.synthetic import TOKENS, batch_shardings, synthetic_batch

__all__ = ["TOKENS", "batch_shardings", "synthetic_batch"]

"""The training and evaluation batches.

- input_pipeline.py: FORMATS, the one table choosing a format module by
  (`dataset_type`, `use_sft`); `make_source(config, global_batch)`, the one entry to
  every dataset; and `put_rows` (a step's rows onto the mesh, each process its own).
- The formats, each one module with `READS`, `train_source` and `eval_source`:
  synthetic.py (seed-determined token batches, and every batch's shardings: `TOKENS`,
  `synthetic_batch`, `batch_shardings`), text_data.py (.txt/.jsonl, tokenizing and
  packing), hf_data.py (parquet), sft_data.py with chat_template.py (conversations,
  masked labels).
- eval_data.py (the eval set: batch size and batches per evaluation),
  eval_schedule.py (when to evaluate).
"""

from trainer.data.synthetic import TOKENS, batch_shardings, synthetic_batch

__all__ = ["TOKENS", "batch_shardings", "synthetic_batch"]

"""The batch contract between the data pipeline, the losses and the trainer.

A batch is a dict of numpy arrays, all [B, T]:
    tokens       int32  input token ids (0 where padding; any id is fine there)
    positions    int32  position of each token inside its own segment (0, 1, 2, ... restarting per segment)
    segment_ids  int32  1, 2, 3 ... for the sequences packed in a row; 0 = padding
    targets      int32  the token to predict at this position: the next token of the SAME segment
                        (whatever is stored where loss_mask is 0)
    loss_mask    float32 1.0 where `targets` is supervised (e.g. assistant tokens), else 0.0
Packing never lets a token attend across segments (see models/layers/attention.py) and never makes a token
predict the first token of the next segment, so a packed row computes exactly its sequences run alone.

Data with images (a vision-language model's: image_batch.py) adds
    pixel_values    float32 [P_pad, D]   the batch's image patches concatenated in row order, zero rows after
    image_grid_thw  int64   [I_pad, 3]   (t, h, w) per image in the same order; (0, 0, 0) rows are padding
    rope_positions  int32   [3, B, T]    M-RoPE (t, h, w) positions per segment (transformers' layout)
"""
from __future__ import annotations

import numpy as np

FIELDS = {"tokens": np.int32, "positions": np.int32, "segment_ids": np.int32, "targets": np.int32,
          "loss_mask": np.float32}


def example_to_row(ids: list[int], mask: list[bool | float], seq_len: int) -> dict[str, np.ndarray]:
    """One unpacked sequence as a row: `mask[t]` says whether ids[t] is a supervised token.

    Token t predicts ids[t + 1], so targets = ids[1:] and loss_mask = mask[1:] (the first token is never a
    target). Truncated to `seq_len` tokens; padded with segment id 0.
    """
    if len(ids) != len(mask):
        raise ValueError(f"ids ({len(ids)}) and mask ({len(mask)}) differ in length")
    ids, mask = list(ids)[:seq_len], list(mask)[:seq_len]
    row = {k: np.zeros((seq_len,), dt) for k, dt in FIELDS.items()}
    n = len(ids)
    row["tokens"][:n] = ids
    row["positions"][:n] = np.arange(n)
    row["segment_ids"][:n] = 1
    row["targets"][:n - 1] = ids[1:]
    row["loss_mask"][:n - 1] = np.asarray(mask[1:], np.float32)
    return row

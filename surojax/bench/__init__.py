"""Training-throughput benchmarks on synthetic packed batches (`surojax bench train`).

shapes.py holds the model shapes (the same as the HF+PEFT anchor's), flops.py the FLOP count behind MFU,
train_bench.py builds the trainer's step and times it. Nothing here imports pydantic or grain, so it runs on
the GPU image as it is.
"""

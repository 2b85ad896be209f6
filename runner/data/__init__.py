"""Token data, split by the process that uses it.

`manifest` (the on-disk format and its validation), `tokenizer` and `prepare` (offline
preparation) are torch-free; `loader` is the trainer's batch stream and imports torch lazily.
"""

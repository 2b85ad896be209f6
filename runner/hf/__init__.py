"""The Hugging Face side of an `m3run export`: `configuration_m3run.py` and `modeling_m3run.py`
are copied as they are into every export folder, where `transformers` loads them with
`trust_remote_code=True`. They import `transformers` (not an m3run dependency) and m3run's
model: nothing in m3run imports them."""

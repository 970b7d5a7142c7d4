"""The refill benchmark's reference consumer: a tiny masked-diffusion language model.

`vocab.py` maps the service's Qwen token ids onto a small local vocabulary, `model.py` is the
bidirectional transformer built from a config and its training loop, `decode.py` block-wise
parallel decoding with a confidence threshold (per request, batch-invariant), `schedulers.py`
static batching and block-grained eviction + token-budgeted refill through the service.
"""

"""Preprocessing on Ray Data: read, template, augment, tokenize, expand images, measure cost.

Modules (one idea each; nothing is imported here so `import pipeline.preprocess.sample` stays
light):
- sources.py       source files, exact row numbering, read plans (chunks), random row reads
- task_size.py     Ray tasks sized by bytes of output: rows per task from a file's first rows
- records.py       raw record -> normalized Conversation (OpenAI / ShareGPT)
- augment.py       cost-changing augmentation seeded by (job seed, epoch, sample_id)
- vision.py        image decoding, Qwen2-VL pixel patches, visual-token counts
- chat_template.py template choice (tokenizer's / qwen2 / qwen3 / file) and rendering with
                   content opaque to the template (`RenderedChat`: the text + where the data is)
- tokenizer.py     `load_tokenizer(cfg)`, cached per process; `ChatTokenizer`: special tokens
                   only where the template wrote them, content as plain text
- labels.py        assistant-only label masks from the turns' real places
- truncation.py    the vision-safe cut of a sample to the sample limit
- array_source.py  samples already in memory (tests, benchmarks)
- process.py       `Processor`: one chunk of raw rows -> ProcessedSample | QuarantinedRecord
                   (whole, or in parts closed by the bytes they hold)
- rows.py          samples <-> Arrow rows (the Ray block schema)
- pipeline.py      Ray wiring: `build_dataset`, `iter_samples`, `SampleStore`, `PreprocessStats`
- sample.py        the output types others code against
"""
